import json

import pytest

from lmforge.components.data.ingest import _extract_file, check_source, corpus_files, extract_docstrings, module_name
from lmforge.components.data.readers import ingest
from lmforge.components.errors import UserError
from lmforge.components.sections.data import DataConfig

SOURCE = b'''"""Module doc."""
import sys

def top(a, *, b=1) -> int:
    """Top level."""
    def inner():
        """Nested."""

class K(Base, metaclass=M):
    """A class."""
    async def run(self):
        """Async method."""
    def bare(self):
        return 1

if sys.platform == "win32":
    def only_windows():
        """Defined under an if."""
'''


def test_extract_docstrings_finds_every_level_with_signatures():
    docs = extract_docstrings(SOURCE, source="stdlib", module="pkg.mod")
    got = {d["qualname"]: d["signature"] for d in docs}
    assert got == {
        "": "module pkg.mod:",
        "top": "def top(a, *, b=1) -> int:",
        "top.<locals>.inner": "def inner():",
        "K": "class K(Base, metaclass=M):",
        "K.run": "async def run(self):",
        "only_windows": "def only_windows():",
    }
    assert docs[0]["docstring"] == "Module doc."


def test_module_names():
    assert module_name("json/__init__.py") == "json"
    assert module_name("email/mime/text.py") == "email.mime.text"


def test_stdlib_corpus_is_read_with_ast_not_import():
    files = corpus_files(include_site_packages=False, skip_tests=True)
    assert len(files) > 300
    assert not any("/test/" in f"/{rel}" or rel.startswith("test/") for _, _, rel in files)
    json_init = next(f for f in files if f[2] == "json/__init__.py")
    docs, mtime, error = _extract_file((json_init[0], str(json_init[1]), json_init[2]))
    assert error is None and mtime > 0
    assert {"dumps", "loads"} <= {d["qualname"] for d in docs}


def test_unparseable_file_is_reported_not_fatal(tmp_path):
    (tmp_path / "py2.py").write_text("print 'hello'\n")
    docs, _, error = _extract_file(("stdlib", str(tmp_path), "py2.py"))
    assert docs == [] and error.startswith("SyntaxError")


@pytest.mark.parametrize("make, problem", [
    (lambda p: p / "missing.jsonl", "does not exist"),
    (lambda p: (p / "x.xml").write_text("<a/>") and p / "x.xml", "unsupported type"),
    (lambda p: p, "no .txt files"),
])
def test_bad_sources_are_user_errors(tmp_path, make, problem):
    with pytest.raises(UserError, match=problem) as e:
        check_source(str(make(tmp_path)))
    assert str(e.value).startswith("data.source: ")


def test_max_docs_sampling_is_seeded_and_keeps_order(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "text": f"doc {i}"}) + "\n" for i in range(100)))
    a = [i.origin for i in ingest(DataConfig(source=str(path), max_docs=10, seed=1)).items]
    b = [i.origin for i in ingest(DataConfig(source=str(path), max_docs=10, seed=1)).items]
    c = [i.origin for i in ingest(DataConfig(source=str(path), max_docs=10, seed=2)).items]
    assert a == b != c and len(a) == 10
    assert a == sorted(a, key=lambda o: int(o.split(":")[1]))
