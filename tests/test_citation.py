"""CITATION.cff and LICENSE: the keys a citation manager needs (CFF 1.2.0) and one licence for both files.

The full check is the Citation File Format's own validator, outside the pinned requirements:
`pip install cffconvert && cffconvert --validate -i CITATION.cff` (cffconvert 2.0.0 accepts this file)."""

import datetime
import re

# PyYAML is installed with wandb (pinned in requirements.txt); a CFF file is YAML, so a parse is the first check
import yaml

from conftest import ROOT


def citation() -> dict:
    return yaml.safe_load((ROOT / "CITATION.cff").read_text())


def test_citation_has_the_keys_of_cff_1_2_0():
    cff = citation()
    # The four keys CFF 1.2.0 requires, and the ones this file promises a reader
    for key in ["cff-version", "message", "title", "authors", "version", "date-released", "abstract", "keywords"]:
        assert cff.get(key), key
    assert cff["cff-version"] == "1.2.0"
    assert re.fullmatch(r"\d+\.\d+\.\d+", str(cff["version"])), cff["version"]
    # CFF dates are YYYY-MM-DD strings; an unquoted date would load as a datetime.date, also a valid date
    datetime.date.fromisoformat(str(cff["date-released"]))
    for author in cff["authors"] + cff["preferred-citation"]["authors"]:
        assert author.get("name") or author.get("family-names"), author


def test_citation_prefers_the_ppg_paper():
    paper = citation()["preferred-citation"]
    assert paper["title"] == "Phasic Policy Gradient"
    assert [a["family-names"] for a in paper["authors"]] == ["Cobbe", "Hilton", "Klimov", "Schulman"]
    assert paper["year"] == 2020
    assert "2009.04416" in paper["url"] and paper["doi"] == "10.48550/arXiv.2009.04416"


def test_citation_and_license_name_one_licence():
    assert citation()["license"] == "MIT"
    first_line, _, copyright_line = (ROOT / "LICENSE").read_text().splitlines()[:3]
    assert first_line == "MIT License"
    assert copyright_line.startswith("Copyright (c) ") and copyright_line.endswith("the ppg authors")
