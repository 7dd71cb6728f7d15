from lmforge.components.data.clean import clean_all, clean_record, clean_text
from lmforge.components.data.validate import Kept
from lmforge.components.serving.records import Record


def test_clean_text_nfc_and_whitespace():
    assert clean_text("cafe\u0301  \r\n\n\n\nx\u00a0y \u200b") == "caf\u00e9\n\nx y"
    assert clean_text("  keep\n    indented\n") == "keep\n    indented"


def test_clean_record_rebuilds_derived_fields():
    r = Record.from_parts(source="s", module="m", qualname="f", signature="def  f(x):",
                          docstring="Cafe\u0301 time.  \n\n\n\nMore.")
    c = clean_record(r)
    assert c.signature == "def f(x):" and c.docstring == "Caf\u00e9 time.\n\nMore."
    assert c.summary == "Caf\u00e9 time." and c.text == Record.from_parts(
        source="s", module="m", qualname="f", signature="def f(x):", docstring=c.docstring).text


def test_record_left_empty_by_cleaning_is_quarantined():
    r = Record(id="z", source="s", module="m", qualname="z", signature="", docstring="\u200b", summary="", text="\u200b")
    kept, bad = clean_all([Kept(r, "f:1", 0.0)])
    assert kept == [] and [b.reason for b in bad] == ["empty"]
