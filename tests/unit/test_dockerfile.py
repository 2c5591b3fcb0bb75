"""docker/Dockerfile parses, and what it installs is pyproject.toml's dependencies and extras less
what NVIDIA's PyTorch container brings (torch and the ``gpu`` extra: transformer-engine,
flash-attn)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
INSTRUCTIONS = {"ARG", "FROM", "WORKDIR", "RUN", "COPY", "ENV", "CMD", "LABEL", "USER"}
FROM_BASE = {"torch"}
"""pyproject requirements the base image satisfies with its own CUDA build."""
EXTRAS_INSTALLED = ("plots", "dev")
EXTRAS_FROM_BASE = ("gpu",)


def instructions() -> list[tuple[str, str]]:
    """(keyword, arguments) per instruction: comments dropped, continuation lines joined."""
    logical, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        current += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            logical.append(current.strip())
            current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    return [(text.split()[0], text.split(maxsplit=1)[1]) for text in logical]


def pip_installs() -> list[list[str]]:
    """The arguments of each ``pip install`` in a RUN (up to the next ``&&``)."""
    found = []
    for keyword, args in instructions():
        if keyword != "RUN":
            continue
        for command in args.split("&&"):
            words = shlex.split(command)
            if words[:2] == ["pip", "install"]:
                found.append(words[2:])
    return found


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_dockerfile_parses():
    parsed = instructions()
    assert {keyword for keyword, _ in parsed} <= INSTRUCTIONS
    keywords = [keyword for keyword, _ in parsed]
    assert keywords.index("FROM") < keywords.index("RUN")
    for keyword, args in parsed:
        if keyword == "COPY":  # every source is in the repository
            for source in args.split()[:-1]:
                assert (ROOT / source).exists(), f"COPY {source}: no such path"


def test_it_installs_exactly_the_dependencies_and_extras():
    project = pyproject()
    wanted = [r for r in project["dependencies"] if re.split(r"[<>=!~ \[]", r)[0] not in FROM_BASE]
    for extra in EXTRAS_INSTALLED:
        wanted += project["optional-dependencies"][extra]
    requirements = [w for words in pip_installs() for w in words if not w.startswith("-")]
    requirements = [r for r in requirements if r not in (".", "-e")]
    assert sorted(requirements) == sorted(wanted)


def test_the_project_goes_in_without_touching_the_base_image():
    project_install = [w for w in pip_installs() if "." in w]
    assert project_install == [["--no-cache-dir", "--no-deps", "--no-build-isolation", "-e", "."]]
    gpu = pyproject()["optional-dependencies"]
    names = {re.split(r"[<>=\[]", r)[0] for e in EXTRAS_FROM_BASE for r in gpu[e]}
    installed = {re.split(r"[<>=\[]", w)[0] for words in pip_installs() for w in words}
    assert not names & installed, "the base image's transformer-engine / flash-attn replaced"
    checks = " ".join(args for keyword, args in instructions() if keyword == "RUN")
    assert "import memo_ext, transformer_engine, flash_attn" in checks


def test_the_readme_names_the_tag_it_was_written_for():
    base = next(args for keyword, args in instructions() if keyword == "ARG")
    tag = base.split("=", 1)[1]
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", tag)
    assert tag in (ROOT / "README.md").read_text()
