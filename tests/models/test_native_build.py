"""Native kernels built in the background while a start converts and loads its models: a later build() of one
waits for that build and takes its module; each is compiled once."""
from __future__ import annotations

import threading

import pytest

from tokenrouter.models import native


@pytest.fixture
def fake_builds(monkeypatch, tmp_path):
    """_build replaced by one that blocks until released and counts its calls; nothing is built on disk."""
    monkeypatch.setenv("TOKENROUTER_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_BUILT", {})
    monkeypatch.setattr(native, "missing", lambda n: "")
    release, calls, started = threading.Event(), [], threading.Semaphore(0)

    def build(n):
        calls.append(n)
        started.release()
        assert release.wait(10)
        return f"module of {n.name}"

    monkeypatch.setattr(native, "_build", build)
    return release, calls, started


def test_a_build_waits_for_the_one_under_way_in_the_background(fake_builds, capsys):
    release, calls, started = fake_builds
    native.build_in_background()
    ahead = [n for n in native.NATIVES if n is not native.AVX2]  # the AVX-VNNI build supersedes it (all can build)
    for _ in ahead:
        assert started.acquire(timeout=10)  # each native's build is under way in a thread of its own
    got = {}
    waiter = threading.Thread(target=lambda: got.update(module=native.build(native.AVXVNNI)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # held until the background build ends
    release.set()
    waiter.join(10)
    assert got["module"] == "module of avxvnni"
    assert sorted(n.name for n in calls) == sorted(n.name for n in ahead)  # compiled once each
    assert native.build(native.VNNI) == "module of vnni"
    assert len(calls) == len(ahead)
    assert native.build(native.AVX2) == "module of avx2" and len(calls) == len(ahead) + 1  # built where asked for
    err = capsys.readouterr().err
    assert "wait for the avxvnni kernels' build" in err
    assert "built avxvnni kernels from avx2_gemm.cpp in the background" in err
    for t in threading.enumerate():  # NOTE: the others may still be returning: the next test counts build threads
        if t.name.startswith("build-"):
            t.join(10)


def test_a_built_module_is_not_built_again_in_the_background(fake_builds):
    release, calls, _ = fake_builds
    release.set()
    for n in native.NATIVES:
        native._module_file(n).parent.mkdir(parents=True)
        native._module_file(n).touch()
    native.build_in_background()
    assert not [t for t in threading.enumerate() if t.name.startswith("build-")]
    assert not calls


def test_a_build_killed_before_does_not_hold_the_next_one(monkeypatch, tmp_path):
    """torch's extension loader waits while its `lock` file exists, and a build killed mid-way (a start stopped
    while the kernels build in the background) leaves it behind: the next build finds it stale and goes on."""
    from torch.utils import cpp_extension
    monkeypatch.setenv("TOKENROUTER_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "missing", lambda n: "")
    directory = native._directory(native.AVX2)
    directory.mkdir(parents=True)
    (directory / "lock").touch()  # what a killed build leaves

    def load(name, build_directory, **_):
        assert not (directory / "lock").exists(), "torch would wait for this lock forever"
        return f"module {name}"

    monkeypatch.setattr(cpp_extension, "load", load)
    assert native._build(native.AVX2) == f"module {native._module_file(native.AVX2).stem}"
