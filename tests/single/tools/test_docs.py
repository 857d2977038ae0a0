"""The documentation site (docs/, mkdocs.yml): it builds with no warning, every file in docs/
is reachable from a page or the nav, every public name of tfsync is in the API reference, and
the README's relative links lead to files that exist.

mkdocs' own validation (mkdocs.yml ``validation:``) reports broken internal links and anchors
as warnings, which ``--strict`` makes errors; the build is one subprocess of a few seconds.
"""

import ast
import pathlib
import re
import subprocess
import sys
import zlib

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"
# the modules whose __all__ is the public API: tfsync itself and its public subpackages
PUBLIC = [
    "tfsync",
    "tfsync.keras",
    "tfsync.distribute",
    "tfsync.elastic",
    "tfsync.faults",
    "tfsync.engine",
    "tfsync.policies",
    "tfsync.ops",
    "tfsync.scheduler",
    "tfsync.timeline",
]
# names in tfsync.__all__ that are modules or metadata, documented by their own members
NOT_OBJECTS = {"tfsync": {"keras", "distribute", "elastic", "__version__"}}
# tfsync.shard is loaded on first use (tfsync.__getattr__), which static analysis cannot follow
DOCUMENTED_AT = {"tfsync.shard": "tfsync._data.shard", "tfsync.shard_dataset": "tfsync._data.shard_dataset"}
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site_dir = tmp_path_factory.mktemp("site")
    try:
        import mkdocs  # noqa: F401
        import mkdocstrings_handlers.python  # noqa: F401
    except ImportError as e:
        pytest.fail(f"the documentation packages are not installed ({e}); run `make install` (requirements-docs.txt)")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,  # (within the test's own limit, so its error is this one; it takes seconds)
    )
    return site_dir, result


def test_the_site_builds_with_no_warning_and_no_broken_link(site):
    _, result = site
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"


def _links(md_file):
    text = md_file.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # commands in code blocks are not links
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        yield (md_file.parent / target.split("#", 1)[0]).resolve()


def _nav_files(nav):
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            if isinstance(value, list):
                yield from _nav_files(value)
            else:
                yield (DOCS / value).resolve()


def test_every_file_in_docs_is_linked_from_a_page_or_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    reached = set(_nav_files(config["nav"]))
    for md_file in DOCS.rglob("*.md"):
        reached.update(_links(md_file))
    files = {p.resolve() for p in DOCS.rglob("*") if p.is_file()}
    unreferenced = sorted(str(p.relative_to(DOCS)) for p in files - reached)
    assert not unreferenced, (
        f"files in docs/ that no page links to and the nav does not list: {unreferenced}; link each from the "
        "page that shows it (a study's data from its results/<study>/README.md) or delete it (git keeps it)"
    )


def _public_names(module):
    path = ROOT / module.replace(".", "/") / "__init__.py"
    if not path.exists():
        path = path.parent.with_suffix(".py")
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return [n for n in ast.literal_eval(node.value) if n not in NOT_OBJECTS.get(module, set())]
    raise AssertionError(f"{path} has no __all__")


def _inventory(site_dir):
    data = (site_dir / "objects.inv").read_bytes()
    header_end = 0
    for _ in range(4):  # four header lines, then zlib
        header_end = data.index(b"\n", header_end) + 1
    return {line.split(" ", 1)[0] for line in zlib.decompress(data[header_end:]).decode().splitlines()}


def test_every_public_name_is_in_the_api_reference(site):
    site_dir, result = site
    assert result.returncode == 0, "the site did not build (see the test above)"
    documented = _inventory(site_dir)
    public = [f"{module}.{name}" for module in PUBLIC for name in _public_names(module)]
    missing = [path for path in public if DOCUMENTED_AT.get(path, path) not in documented]
    assert not missing, f"public names missing from docs/api.md: {missing}; add a `::: module.name` entry"


def test_the_readme_links_lead_to_files_that_exist():
    missing = [str(p) for p in _links(ROOT / "README.md") if not p.exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_readme_stays_short():
    # a user's page: what tfsync is, install, quick start, choosing a mode, errors, limits;
    # everything else belongs to docs/
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 250, f"README.md has {lines} lines; move detail into docs/ and link it"
