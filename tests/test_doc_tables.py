"""docs/MEASUREMENTS.md: the generated tables equal what their committed JSON gives
(bench/doc_tables.py), and every citation of a section names a heading that exists.

Fast: no jax, no model; the check runs in-process.
"""
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import doc_tables  # noqa: E402  (bench/ is not a package)


def test_generated_tables_are_current():
    assert doc_tables.check() is None, doc_tables.check()
    assert doc_tables.main(["--check"]) == 0


@pytest.fixture
def tmp_root(tmp_path):
    """A copy of docs/MEASUREMENTS.md and every JSON its tables are rendered from."""
    files = {str(doc_tables.DOC)} | {f for _, fs in doc_tables.TABLES.values() for f in fs}
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / f, tmp_path / f)
    assert doc_tables.check(root=tmp_path) is None
    return tmp_path


def _bump(root: Path, rel: str, edit) -> None:
    path = root / rel
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))


@pytest.mark.parametrize("name, rel, edit", [
    ("parity-matrix", "docs/parity/matrix-summary.json", lambda d: d["runs"][0].update(checks=235)),
    ("parity-selftest", "docs/parity/selftest.json", lambda d: d["faults"][4].update(margin=1.5)),
    ("train-step", "docs/perf/train_step_2026-12-04.json",
     lambda d: d["fine"]["tokens_per_s"].update(jaxmoe=999.0)),
    ("gpu-memory", "docs/perf/gpu_memory_cpu_proxy_flash_2026-12-06.json",
     lambda d: d["variants"][0].update(fits_48GB=False)),
])
def test_a_changed_json_value_makes_the_check_fail(tmp_root, capsys, name, rel, edit):
    _bump(tmp_root, rel, edit)
    msg = doc_tables.check(root=tmp_root)
    assert msg and f"table {name} is stale" in msg and "\n" not in msg
    assert doc_tables.main(["--check"], root=tmp_root) == 1
    assert capsys.readouterr().err.count("\n") == 1
    # rewriting brings the file back in line, and touches only that region
    before = (tmp_root / doc_tables.DOC).read_text()
    assert doc_tables.main([], root=tmp_root) == 0
    after = (tmp_root / doc_tables.DOC).read_text()
    assert doc_tables.check(root=tmp_root) is None and after != before
    assert after.split(doc_tables.BEGIN.format(name=name))[0] == before.split(doc_tables.BEGIN.format(name=name))[0]


def test_a_hand_edited_or_missing_region_is_named(tmp_root):
    doc = tmp_root / doc_tables.DOC
    text = doc.read_text()
    doc.write_text(text.replace("| tiny-force-jax | torch_ref | pass |", "| tiny-force-jax | torch_ref | FAIL |"))
    assert "table parity-matrix is stale" in doc_tables.check(root=tmp_root)
    doc.write_text(text.replace(doc_tables.BEGIN.format(name="gpu-h200"), ""))
    assert "table gpu-h200 has no generated region" in doc_tables.check(root=tmp_root)
    (tmp_root / "docs/parity/selftest.json").unlink()
    doc.write_text(text)
    with pytest.raises(doc_tables.DocTablesError, match="table parity-selftest: cannot read docs/parity/selftest.json"):
        doc_tables.check(root=tmp_root)
    assert doc_tables.main(["--check"], root=tmp_root) == 2


# --- citations: `docs/MEASUREMENTS.md, "Heading"` must name a heading of that file --------------

_CITE = re.compile(r'(docs/(?:history/)?MEASUREMENTS[\w-]*\.md)(?:,\s*|\s+|\s*\(\s*)"([^"]{1,160})"')
_SCANNED = ["jaxmoe", "parity", "bench", "tests"]


def _citations(text: str):
    for m in _CITE.finditer(text):
        # a citation may wrap onto the next line of a comment or docstring
        yield m.group(1), " ".join(re.sub(r"\n\s*#?\s*", " ", m.group(2)).split())


def _headings(path: Path) -> list[str]:
    return [line.lstrip("#").strip().lower() for line in path.read_text().splitlines()
            if line.startswith(("## ", "### "))]


def _dangling(files) -> list[str]:
    heads = {}
    bad = []
    for f in files:
        for doc, cited in _citations(f.read_text()):
            if doc not in heads:
                heads[doc] = _headings(ROOT / doc) if (ROOT / doc).exists() else []
            if not any(h.startswith(cited.lower()) for h in heads[doc]):
                name = f.relative_to(ROOT) if f.is_relative_to(ROOT) else f.name
                bad.append(f"{name}: {doc}, \"{cited}\"")
    return bad


def _cited_files():
    me = Path(__file__).resolve()
    for folder in _SCANNED:
        yield from (f for f in sorted((ROOT / folder).rglob("*.py")) if f.resolve() != me)
    yield ROOT / "README.md"
    yield from sorted((ROOT / "docs").glob("*.md"))


def test_every_cited_heading_exists():
    files = list(_cited_files())
    found = [c for f in files for c in _citations(f.read_text())]
    # the scan sees the citations it is meant to (one of them wraps across lines)
    assert ("docs/MEASUREMENTS.md", "Parity, decisive weights") in found
    assert ("docs/MEASUREMENTS.md", "Planner: europa-952b layouts") in found
    assert ("docs/history/MEASUREMENTS-2026-12.md", "Conversion: byte copies in destination order") in found
    assert len(found) >= 10, found
    bad = _dangling(files)
    assert not bad, "citations naming no heading (fix the heading or the citation):\n" + "\n".join(bad)


def test_a_citation_of_a_missing_heading_is_reported(tmp_path):
    f = tmp_path / "x.py"
    f.write_text('# figures: docs/MEASUREMENTS.md, "Train step"\n'
                 '# figures: docs/MEASUREMENTS.md ("No such\n# section")\n')
    bad = _dangling([f])
    assert len(bad) == 1 and '"No such section"' in bad[0]
