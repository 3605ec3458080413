"""The C kernels' cache (common/native/build.py) runs only what this user built: a planted or
foreign library is rebuilt, a foreign folder is passed over, and a hung compiler times out."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from common.native import build
from common.settings import KERNEL_CACHE_ENV, MARCH_ENV

SOURCE = "int pdserve_answer(void) { return 42; }\n"
NOBODY = 65534


@pytest.fixture
def kernels(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "kernels"
    monkeypatch.setenv(KERNEL_CACHE_ENV, str(folder))
    monkeypatch.delenv(MARCH_ENV, raising=False)  # "native" is this CPU's here
    return folder


@pytest.fixture
def source(tmp_path) -> Path:
    path = tmp_path / "answer.c"
    path.write_text(SOURCE)
    return path


def _needs_root():
    if os.geteuid() != 0:
        pytest.skip("making a file of another user needs root")


def test_builds_into_a_private_folder_and_reuses_the_library(kernels, source):
    assert build.load_library(source).pdserve_answer() == 42
    assert stat.S_IMODE(kernels.stat().st_mode) == 0o700
    library = build.library_path(source)
    info = library.stat()
    assert info.st_uid == os.geteuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    assert build.load_library(source).pdserve_answer() == 42
    assert library.stat().st_ino == info.st_ino  # not rebuilt


def test_an_open_folder_of_ours_is_closed(kernels, source):
    kernels.mkdir(mode=0o777)
    kernels.chmod(0o777)
    assert build.load_library(source).pdserve_answer() == 42
    assert stat.S_IMODE(kernels.stat().st_mode) == 0o700


def test_a_library_others_may_write_is_rebuilt(kernels, source):
    library = build.library_path(source)
    library.write_bytes(b"planted")  # what another user could have written there
    library.chmod(0o666)
    assert build.load_library(source).pdserve_answer() == 42
    assert library.read_bytes()[:4] == b"\x7fELF"
    assert not library.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def test_a_link_in_place_of_the_library_is_rebuilt(kernels, source, tmp_path):
    library = build.library_path(source)
    elsewhere = tmp_path / "elsewhere.so"
    elsewhere.write_bytes(b"planted")
    library.symlink_to(elsewhere)
    assert build.load_library(source).pdserve_answer() == 42
    assert not library.is_symlink() and elsewhere.read_bytes() == b"planted"


def test_a_library_of_another_user_is_rebuilt(kernels, source):
    _needs_root()
    library = build.library_path(source)
    library.write_bytes(b"planted")
    library.chmod(0o644)
    os.chown(library, NOBODY, NOBODY)
    assert build.load_library(source).pdserve_answer() == 42
    assert library.stat().st_uid == os.geteuid()


def test_a_folder_of_another_user_is_passed_over(kernels, source):
    _needs_root()
    kernels.mkdir()
    os.chown(kernels, NOBODY, NOBODY)
    assert build.load_library(source).pdserve_answer() == 42
    assert not list(kernels.iterdir())  # built in a private folder instead
    assert build.kernel_dir() != kernels


def test_the_key_holds_the_compiler_version(kernels, source, tmp_path, monkeypatch):
    first = build.library_path(source)
    other = tmp_path / "other-gcc"  # the same gcc, telling another version
    other.write_text(
        f'#!/bin/sh\n[ "$1" = --version ] && echo "gcc 99.1" && exit 0\n'
        f'exec {shutil.which("gcc")} "$@"\n'
    )
    other.chmod(0o755)
    monkeypatch.setenv("CC", str(other))
    assert build.library_path(source) != first
    assert build.load_library(source).pdserve_answer() == 42


def test_a_hung_compiler_times_out(kernels, source, tmp_path, monkeypatch, caplog):
    hung = tmp_path / "hung-gcc"
    hung.write_text('#!/bin/sh\n[ "$1" = --version ] && exit 0\nexec sleep 60\n')
    hung.chmod(0o755)
    monkeypatch.setenv("CC", str(hung))
    monkeypatch.setattr(build, "BUILD_TIMEOUT_S", 1.0)
    assert build.load_library(source) is None
    assert "did not build in 1 s" in caplog.text
    assert not list(kernels.glob("answer-*.so"))


def test_march_builds_another_instruction_set(kernels, source):
    assert build.library_path(source, march="x86-64-v3") != build.library_path(source)
    assert build.load_library(source, march="x86-64-v3").pdserve_answer() == 42


def test_the_march_variable_replaces_native(kernels, source, tmp_path, monkeypatch):
    """$PDSERVE_KERNEL_MARCH builds "native" for that instruction set: the same library as
    asking for it by name (the AVX2-on-AVX-512 runs of docs/benchmarks.md), and gcc was told so."""
    log = tmp_path / "cc.log"
    cc = tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec {shutil.which("gcc")} "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv(MARCH_ENV, "x86-64-v3")
    assert build.library_path(source) == build.library_path(source, march="x86-64-v3")
    assert build.load_library(source).pdserve_answer() == 42
    assert "-march=x86-64-v3" in log.read_text().split()
    monkeypatch.delenv(MARCH_ENV)
    assert build.library_path(source) != build.library_path(source, march="x86-64-v3")
