"""api.validation.real_path: the real path of a job's local file, as os.path.realpath gives it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from api import validation
from api.validation import real_path


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Files, directories and symlinks of every kind, inside and outside a data root; cwd inside it."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "datasets" / "deep").mkdir(parents=True)
    outside.mkdir()
    (root / "datasets" / "train.txt").write_text("x")
    (outside / "secret.txt").write_text("x")
    (root / "datasets" / "to-secret.txt").symlink_to(outside / "secret.txt")  # absolute, to a file
    (root / "datasets" / "relative.txt").symlink_to("../datasets/train.txt")  # relative, inside
    (root / "datasets" / "dangling.txt").symlink_to(outside / "not-yet.txt")  # dangling, to outside
    (root / "datasets" / "loop.txt").symlink_to("loop.txt")
    (root / "escape").symlink_to(outside)  # a directory symlink
    (root / "chain").symlink_to("escape")  # a link to a link
    (root / "fifo").mkdir()
    os.mkfifo(root / "fifo" / "pipe")  # opened with O_PATH: no waiting for a writer
    monkeypatch.chdir(root / "datasets")
    return tmp_path


CASES = [
    "root/datasets/train.txt",
    "root/datasets/missing.txt",  # not uploaded yet: the directory's real path and the name
    "root/missing-dir/missing.txt",
    "root/datasets/to-secret.txt",
    "root/datasets/relative.txt",
    "root/datasets/dangling.txt",
    "root/datasets/loop.txt",
    "root/escape/secret.txt",
    "root/escape/missing.txt",
    "root/chain/secret.txt",
    "root/escape",
    "root/chain",
    "root/datasets/../escape/secret.txt",
    "root/escape/../datasets/train.txt",  # .. after a symlink: the link's target's parent
    "root/datasets/train.txt/..",
    "root/datasets/.",
    "root/datasets/",
    "root//datasets///train.txt",
    "root/datasets/deep/../../datasets/train.txt",
    "root/datasets/train.txt/more",  # under a file
    "root/fifo/pipe",
    "root",
    "",
]


@pytest.mark.parametrize("case", CASES)
def test_real_path_is_realpath(tree: Path, case: str) -> None:
    path = f"{tree}/{case}" if case else str(tree)
    assert real_path(path) == os.path.realpath(path)


RELATIVE = ["train.txt", "missing.txt", "to-secret.txt", "./train.txt", "../escape/x", "."]


@pytest.mark.parametrize("case", RELATIVE)
def test_relative_paths_resolve_from_the_working_directory(tree: Path, case: str) -> None:
    assert real_path(case) == os.path.realpath(case)


def test_the_kernel_is_asked(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On Linux the common cases do not fall back to realpath (which would make the tests above pass
    whatever real_path did)."""
    if validation._O_PATH_DIRECTORY is None:
        pytest.skip("no O_PATH or /proc here: real_path is realpath")

    cases = ["root/datasets/train.txt", "root/datasets/missing.txt", "root/escape/secret.txt", "root/chain/x"]
    expected = {case: os.path.realpath(f"{tree}/{case}") for case in cases}

    def no_realpath(path: str) -> str:
        raise AssertionError(f"realpath({path!r})")

    monkeypatch.setattr(validation.os.path, "realpath", no_realpath)
    assert {case: real_path(f"{tree}/{case}") for case in cases} == expected
