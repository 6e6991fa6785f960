"""The user's cache folders outside a pod (llamaft.api.cache_folders), as the local run's download
caches and the CEL parser's file both find them."""

from __future__ import annotations

import pytest
from llamaft.api import cache_folders, cel_parser
from llamaft.launch import local_cache

CASES = [
    ({"LLAMAFT_CACHE": "/c/llamaft", "XDG_CACHE_HOME": "/x", "HOME": "/h"}, "/c/llamaft", "/x/huggingface"),
    ({"XDG_CACHE_HOME": "/x", "HOME": "/h"}, "/x/llamaft", "/x/huggingface"),
    ({"HOME": "/h"}, "/h/.cache/llamaft", "/h/.cache/huggingface"),
    ({"HOME": "/h", "HF_HOME": "/hf"}, "/h/.cache/llamaft", "/hf"),
]


@pytest.mark.parametrize(("environ", "llamaft", "hf"), CASES)
def test_one_answer_for_every_cache(environ: dict[str, str], llamaft: str, hf: str) -> None:
    assert str(cache_folders.llamaft_cache(environ)) == llamaft
    assert str(cel_parser.cache_dir(environ)) == llamaft
    local = local_cache(environ)
    assert local["LLAMAFT_CACHE"] == llamaft and local["HF_HOME"] == hf
