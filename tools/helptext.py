"""The tools' --help: each option followed by its default, as argparse's ArgumentDefaultsHelpFormatter writes it."""

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's " (default: X)" after each option's help, except where it would say nothing: a required option, an
    on/off flag (off by default), a default of None (the help says what then happens) or an empty list."""

    def _get_help_string(self, action):
        if action.required or action.nargs == 0 or action.default is None or action.default == []:
            return action.help
        return super()._get_help_string(action)
