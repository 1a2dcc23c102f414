"""Dockerfile.api and Dockerfile.worker, as far as a machine without Docker can check them."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
DOCKERFILES = ("Dockerfile.api", "Dockerfile.worker")
# A tag with an exact version (x.y.z...), or a digest: never `latest` or a moving `3.12-slim`.
PINNED = re.compile(r"^[\w./-]+(:[\w.-]*\d+\.\d+\.\d+[\w.-]*)?(@sha256:[0-9a-f]{64})?$")


def instructions(name: str) -> list[tuple[str, str]]:
    text = (ROOT / name).read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_base_images_are_pinned(name: str) -> None:
    stages: set[str] = set()
    for op, args in instructions(name):
        if op == "FROM":
            image, *rest = args.split()
            if image not in stages:
                assert PINNED.match(image) and (":" in image or "@" in image), (
                    f"{name}: {image} is not pinned"
                )
            if rest[:1] == ["AS"] or rest[:1] == ["as"]:
                stages.add(rest[1])
        if op == "COPY" and args.startswith("--from="):
            source = args.split()[0].removeprefix("--from=")
            assert source in stages, f"{name}: COPY --from={source} names no stage"


@pytest.mark.parametrize(("name", "module"), [("Dockerfile.api", "api.cli"), ("Dockerfile.worker", "worker")])
def test_the_entrypoint_is_a_module_of_the_project(name: str, module: str) -> None:
    (entrypoint,) = [json.loads(args) for op, args in instructions(name) if op == "ENTRYPOINT"]
    assert entrypoint[:3] == ["python", "-m", module]
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    if module == "worker":
        assert importlib.util.find_spec("worker.__main__") is not None


@pytest.mark.parametrize(("name", "extra"), [("Dockerfile.api", False), ("Dockerfile.worker", True)])
def test_dependencies_come_from_the_lock(name: str, extra: bool) -> None:
    syncs = [args for op, args in instructions(name) if op == "RUN" and "uv sync" in args]
    assert syncs and all("--locked" in s and "--no-dev" in s for s in syncs)
    assert all(("--extra worker" in s) == extra for s in syncs)
    copied = {
        src
        for op, args in instructions(name)
        if op == "COPY"
        for src in args.split()[:-1]
        if not src.startswith("--")
    }
    assert {"uv.lock", "pyproject.toml"} <= copied


def test_the_api_image_runs_as_a_user_and_the_worker_image_has_one() -> None:
    users = [args for op, args in instructions("Dockerfile.api") if op == "USER"]
    assert users and not users[-1].startswith(("0", "root"))
    assert any("useradd" in args for op, args in instructions("Dockerfile.worker") if op == "RUN")


def test_dockerignore_lets_in_exactly_what_the_images_copy() -> None:
    allowed = {
        line.removeprefix("!").rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    for name in DOCKERFILES:
        copied = {
            src.rstrip("/")
            for op, args in instructions(name)
            if op == "COPY" and not args.startswith("--from")
            for src in args.split()[:-1]
        }
        assert copied <= allowed, (name, copied - allowed)


def test_the_api_never_imports_jax() -> None:
    """The API image has no JAX stack: nothing the API imports may need it."""
    code = (
        "import sys, api.main, api.cli, api.executors.kubernetes, api.leader, api.jobset;"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'jaxlib', 'numpy', 'flax', 'orbax'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
