"""test_realclient's server run with chunk_tokens=0 (whole entries only, no
chains): every candidate kvtier offers is then the reference's own."""

from __future__ import annotations

import pytest

from test_realclient import MODELS, check_real_client


@pytest.mark.parametrize("path", ["sync", "async"])
@pytest.mark.parametrize("name", list(MODELS))
def test_real_client_no_chunks(tmp_path, name, path):
    check_real_client(tmp_path, name, path, "chunk_tokens=0")
