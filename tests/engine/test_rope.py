"""RoPE against transformers: YaRN's frequencies and cos/sin scale as DeepSeek-V3
configures them, and the interleaved layout its checkpoints use."""

from __future__ import annotations

import pytest
import torch

from engine.attention.context import forward_context
from engine.attention.torch_backend import TorchBackend
from engine.config.model import _rope_scaling
from engine.layers.rotary_embedding import RotaryEmbedding, attention_factor, inverse_frequencies

ROPE_DIM, MAX_POS = 16, 256
YARN = {  # DeepSeek-V3's own settings, on a shorter original context
    "rope_type": "yarn",
    "factor": 8.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def hf_rope(rope_parameters: dict, interleave: bool):
    import transformers
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    cfg = transformers.DeepseekV3Config(
        hidden_size=64,
        num_attention_heads=4,
        qk_rope_head_dim=ROPE_DIM,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=MAX_POS,
        rope_parameters=rope_parameters,
        rope_interleave=interleave,
    )
    apply = m.apply_rotary_pos_emb_interleave if interleave else m.apply_rotary_pos_emb
    return cfg, m.DeepseekV3RotaryEmbedding(cfg), apply


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "neox"])
@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {**YARN, "rope_theta": 10000.0},
        {**YARN, "rope_theta": 500.0, "mscale": 0.707, "beta_fast": 16},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0},  # transformers' defaults
    ],
    ids=["default", "yarn", "yarn-mscale", "yarn-defaults"],
)
def test_rotary_matches_transformers(rope: dict, interleave: bool) -> None:
    cfg, hf, apply = hf_rope(dict(rope), interleave)
    scaling = _rope_scaling(dict(rope), {"max_position_embeddings": MAX_POS})
    ours = RotaryEmbedding(ROPE_DIM, MAX_POS, rope["rope_theta"], scaling, interleaved=interleave)
    assert torch.equal(inverse_frequencies(ROPE_DIM, rope["rope_theta"], scaling), hf.inv_freq)
    positions = torch.randint(0, MAX_POS, (40,))
    q, k = torch.randn(40, 4, ROPE_DIM), torch.randn(40, 1, ROPE_DIM)
    cos, sin = hf(q, positions[None])
    hf_q, hf_k = apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    with forward_context(None, None, TorchBackend(block_size=16)):  # torch's RoPE
        got_q, got_k = ours(positions, q, k)
    torch.testing.assert_close(got_q, hf_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, hf_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    # The cases cover YaRN's cos/sin scale both at 1 (mscale == mscale_all_dim) and not.
    assert hf.attention_scaling == attention_factor(scaling)
