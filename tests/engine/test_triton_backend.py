"""The engine's decode on its GPU attention kernels equals its torch reference path.

Without a GPU the Triton kernels run under the interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET``), so the kernels' wiring into the model (which tensors they read and
which K/V slots they write, step after step, and level 1's rows within a prefill) is
checked on the CPU too.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import ARCHS, random_catalog, sequential_sid_map
from xgr import Engine
from xgr.engine.generate import launch_semantic_ids


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("lengths", [[23], [9, 31]], ids=["one request", "two requests"])
def test_triton_decode_equals_the_torch_path(model_dirs, arch, lengths):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton reads CPU tensors only interpreted")
    catalog = random_catalog(300, 3, 16, seed=5)
    engine = Engine.from_pretrained(
        model_dirs[arch], catalog=catalog, sid_token_ids=sequential_sid_map(3, 16, 40),
        device=device, cuda_graphs=False,
    )  # fmt: skip
    spec, runner = engine.decode_spec, engine.runner
    # One request runs level 1 within its prefill (its code rows take the kernel there).
    assert runner.first_levels_together(len(lengths), 16) == (len(lengths) == 1)
    gen = torch.Generator().manual_seed(len(lengths))
    prompts = [torch.randint(2, 40, (n,), generator=gen).tolist() for n in lengths]
    runner.attention_backend = "torch"
    want = launch_semantic_ids(spec, prompts, 16, 16).wait()
    runner.attention_backend = "triton"
    got = launch_semantic_ids(spec, prompts, 16, 16).wait()
    assert torch.equal(got.sid_index.cpu(), want.sid_index.cpu())
    torch.testing.assert_close(got.scores.cpu(), want.scores.cpu(), atol=1e-5, rtol=1e-5)
