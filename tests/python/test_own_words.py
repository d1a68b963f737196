"""No Python file of the project holds text transcribed from outside code:
scripts/own_words.py over every tracked .py of bindings/, tests/, bench/,
scripts/ and tools/ finds no run of six or more lines also in the
reference's source (the seed's blocks) or in the upstream client's files.
Needs ../shared (or $KVT_SHARED_DIR); without it the test is a skip tagged
seed, which CI's strict mode fails.  To see the runs of one's own work:
``scripts/own_words.py [FILE...]``."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "scripts"))

import own_words  # noqa: E402
import reference_loader  # noqa: E402


def test_no_run_of_six_transcribed_lines():
    files = own_words.project_files()
    assert len(files) > 30 and "bindings/python/kvtier/ssd_cache.py" in files
    try:
        runs = own_words.find_runs(files)
    except reference_loader.ReferenceUnavailable as e:
        reference_loader.unavailable(str(e))
    assert runs == [], "transcribed runs:\n" + "\n".join(map(own_words.format_run, runs))
