#!/usr/bin/python3
"""Runs the vllm-mlx project's own SSD-tier tests against kvtier.ssd_cache.

Given a checkout (or bare git directory) of vllm-mlx, this copies its
tests/test_ssd_cache*.py and the client modules they import
(vllm_mlx/memory_cache.py, vllm_mlx/scheduler.py) into a fresh temporary
directory outside this repository, writes a conftest of ours there that maps
``vllm_mlx.ssd_cache`` to ``kvtier.ssd_cache`` (and ``mlx.core`` to the
project's numpy stand-in when MLX is absent), runs pytest on them, prints the
pass/fail counts, and deletes the directory.  Nothing of theirs is kept in
this repository: the tests are read from the given path at run time.

    scripts/run-upstream-ssd-tests.py /path/to/vllm-mlx [--rev REV]
        [--library build/libkvtier.so] [--keep] [-- extra pytest args]

Exit status: pytest's (0 when every test passed or was skipped).  The
differences this run still shows are listed, with their reasons, in
bindings/python/README.md.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_GLOB = "tests/test_ssd_cache*.py"
CLIENT_MODULES = ("vllm_mlx/memory_cache.py", "vllm_mlx/scheduler.py")

# The conftest written beside the copied tests.  It is ours: it only wires
# module names and runs anyio-marked coroutines (pytest's anyio plugin is not
# a Debian package) on asyncio.
CONFTEST = '''\
"""Maps vllm_mlx.ssd_cache to kvtier.ssd_cache for vllm-mlx's own tests
(written by scripts/run-upstream-ssd-tests.py)."""
import asyncio
import inspect
import os
import sys
import types

import pytest

ROOT = os.environ["KVT_ROOT"]
for p in (os.path.join(ROOT, "bindings", "python"), os.path.join(ROOT, "tests", "reference")):
    if p not in sys.path:
        sys.path.insert(0, p)

if os.environ.get("KVT_MLX_STANDIN") == "1":
    import mlx_standin
    mlx = types.ModuleType("mlx")
    mlx.__path__ = []
    mlx.core = mlx_standin
    sys.modules["mlx"] = mlx
    sys.modules["mlx.core"] = mlx_standin

import kvtier.ssd_cache

here = os.path.dirname(os.path.abspath(__file__))
pkg = types.ModuleType("vllm_mlx")
pkg.__path__ = [os.path.join(here, "vllm_mlx")]
pkg.ssd_cache = kvtier.ssd_cache
sys.modules["vllm_mlx"] = pkg
sys.modules["vllm_mlx.ssd_cache"] = kvtier.ssd_cache


def pytest_configure(config):
    config.addinivalue_line("markers", "anyio: run the coroutine test on asyncio")
    config.addinivalue_line("markers", "slow: upstream marker")
    config.addinivalue_line("markers", "integration: upstream marker")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    fn = pyfuncitem.obj
    if pyfuncitem.get_closest_marker("anyio") and inspect.iscoroutinefunction(fn):
        names = pyfuncitem._fixtureinfo.argnames
        asyncio.run(fn(**{n: pyfuncitem.funcargs[n] for n in names}))
        return True
    return None
'''


def _git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], check=True,
                          capture_output=True, text=True).stdout


def _is_git(repo: str) -> bool:
    return subprocess.run(["git", "-C", repo, "rev-parse", "--git-dir"],
                          capture_output=True).returncode == 0


def _files(repo: str, rev: str) -> dict[str, str]:
    """{path: text} of the tests and client modules, from git (rev) when the
    path is a git directory, else from the files below it."""
    want = {}
    if _is_git(repo):
        names = _git(repo, "ls-tree", "-r", "--name-only", rev).splitlines()
        for n in names:
            if fnmatch.fnmatch(n, TEST_GLOB) or n in CLIENT_MODULES:
                want[n] = _git(repo, "show", f"{rev}:{n}")
    else:
        tests = os.path.join(repo, "tests")
        for n in sorted(os.listdir(tests)):
            if fnmatch.fnmatch("tests/" + n, TEST_GLOB):
                with open(os.path.join(tests, n), encoding="utf-8") as f:
                    want["tests/" + n] = f.read()
        for n in CLIENT_MODULES:
            p = os.path.join(repo, n)
            if os.path.exists(p):
                with open(p, encoding="utf-8") as f:
                    want[n] = f.read()
    if not any(n.startswith("tests/") for n in want):
        sys.exit(f"no {TEST_GLOB} in {repo}")
    return want


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("repo", help="vllm-mlx checkout or git directory")
    ap.add_argument("--rev", default="HEAD", help="revision, for a git directory")
    ap.add_argument("--library", default=os.path.join(ROOT, "build", "libkvtier.so"),
                    help="libkvtier to load (KVTIER_LIBRARY)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    a = ap.parse_args()

    files = _files(os.path.abspath(a.repo), a.rev)
    tmp = tempfile.mkdtemp(prefix="kvtier-upstream-ssd-")
    try:
        os.makedirs(os.path.join(tmp, "vllm_mlx"))
        for name, text in files.items():
            dest = os.path.join(tmp, os.path.basename(name) if name.startswith("tests/")
                                else name)
            with open(dest, "w", encoding="utf-8") as f:
                f.write(text)
        with open(os.path.join(tmp, "conftest.py"), "w", encoding="utf-8") as f:
            f.write(CONFTEST)
        env = dict(os.environ, KVT_ROOT=ROOT, KVTIER_LIBRARY=os.path.abspath(a.library),
                   PYTHONDONTWRITEBYTECODE="1")
        tests = sorted(os.path.basename(n) for n in files if n.startswith("tests/"))
        print(f"upstream tests: {', '.join(tests)} (from {a.repo} {a.rev}); dir {tmp}",
              flush=True)
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs",
               "--rootdir", tmp, *tests, *a.pytest_args]
        rc = subprocess.run(cmd, cwd=tmp, env=env).returncode
        print("note: TestCLIIntegration and test_scheduler_reconstructs_real_arrays_cache "
              "import vllm_mlx.scheduler / mlx_lm, which need MLX (set KVT_MLX_STANDIN=1 "
              "for the numpy stand-in of mlx.core); they test the scheduler, not the SSD tier")
        return rc
    finally:
        if a.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
