"""The documentation: the configuration reference against the schema, the README, the site build.

Mirrors laminar_mcore/config/reference.py (the reference's generator and comment convention)
and checks what `make docs` builds: the whole site in MkDocs' strict mode, where a broken link
or anchor fails.
"""

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import typing

import pytest

from laminar_mcore.config import reference, schema

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE_MD = os.path.join(ROOT, "docs", "configuration.md")


def schema_keys(cls=schema.LaminarConfig, prefix=""):
    """Every dotted key of the schema, walked independently of the generator."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        yield prefix + f.name
        if dataclasses.is_dataclass(hints[f.name]):
            yield from schema_keys(hints[f.name], prefix + f.name + ".")


def test_every_schema_field_has_a_comment():
    missing = reference.undocumented()
    assert not missing, (
        f"schema fields without a comment: {', '.join(missing)}. In "
        "laminar_mcore/config/schema.py give each field a comment: '#' lines directly above it "
        "or a comment at the end of its line (see laminar_mcore/config/reference.py), then run "
        "python -m laminar_mcore.config.reference --out docs/configuration.md")


def test_reference_lists_every_field_with_type_default_and_comment():
    page = reference.render()
    by_path = {k.path: k for k in reference.keys()}
    assert list(by_path) == list(schema_keys())
    for path, key in by_path.items():
        start = f"| `{path}` | [section]" if key.section else f'| <a id="{path}"></a>`{path}` |'
        row = next((line for line in page.splitlines() if line.startswith(start)), None)
        assert row is not None, f"{path} is not in the reference"
        if key.section is None:
            assert f"`{key.type}`" in row and f"`{key.default}`" in row, row
        assert reference._cell(key.comment) in row, row
    assert "`trainer.max_restarts` | `int` | `2` |" in page
    assert "`algo.max_staleness` | `int or null` | `null` |" in page
    assert "`model.path` | `str or null` | `??? (mandatory)` |" in page


def test_reference_lists_every_config_group_option():
    page = reference.render()
    conf = os.path.join(ROOT, "conf")
    for group in (d for d in os.listdir(conf) if os.path.isdir(os.path.join(conf, d))
                  and not d.startswith("_")):
        for name in os.listdir(os.path.join(conf, group)):
            if name.endswith(".yaml"):
                assert f"| `{group}` |" in page and f"`{name[:-5]}`" in page, (group, name)
    assert "| `experiment` | **`cpu_demo`** |" in page  # the default is bold


def test_comment_convention():
    fields, docs = reference.parse_comments('''
@dataclass
class Section:
    """What it is."""

    above: int = 1
    # Two lines above,
    # joined.
    both: int = 2  # and the end of its line
    trailing: str = "a#b"  # only here
    # A comment separated from the field by a blank line documents nothing.

    bare: bool = False
    multi: List[int] = field(
        default_factory=list)  # on its last line
''')
    assert docs == {"Section": "What it is."}
    assert fields["Section"] == {
        "above": "", "both": "Two lines above, joined. and the end of its line",
        "trailing": "only here", "bare": "", "multi": "on its last line"}


def test_committed_reference_is_current():
    with open(REFERENCE_MD, encoding="utf-8") as f:
        committed = f.read()
    assert committed == reference.render(), (
        "docs/configuration.md is stale: run "
        "python -m laminar_mcore.config.reference --out docs/configuration.md")


def test_readme_is_short_and_its_links_resolve():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    assert len(text.splitlines()) <= 250, "README.md is over 250 lines: move details to docs/"
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert any(t.startswith("docs/") for t in targets)
    for target in targets:
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            continue
        path = target.split("#")[0]
        assert os.path.exists(os.path.join(ROOT, path)), f"README links to missing {target}"


def test_benchmarks_page_covers_every_benchmark():
    with open(os.path.join(ROOT, "docs", "benchmarks.md"), encoding="utf-8") as f:
        page = f.read()
    bench = os.path.join(ROOT, "laminar_mcore", "bench")
    modules = [n[:-3] for n in os.listdir(bench)
               if n.endswith(".py") and n not in ("__init__.py", "common.py", "reference.py")]
    for name in modules + ["sim.report", "sim.calibrate"]:
        name = name if name.startswith("sim.") else f"bench.{name}"
        assert f"## `{name}`" in page and f"python -m laminar_mcore.{name}" in page, name


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or
                    importlib.util.find_spec("material") is None,
                    reason="mkdocs and mkdocs-material are not installed (requirements-dev.txt)")
def test_site_builds_in_strict_mode(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    page = (tmp_path / "site" / "configuration" / "index.html").read_text(encoding="utf-8")
    assert 'id="trainer.batch_timeout_s"' in page  # the hook rendered the reference
