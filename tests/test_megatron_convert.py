"""HF <-> Megatron-Core weight conversion (model_engine.megatron.convert); no Megatron needed."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from polyrl.model_engine.megatron import convert as cv
from polyrl.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mcore_tiny")
    return {
        a: build_tiny_model(a, root / a, size="nano")
        for a in ("qwen2", "llama", "qwen3", "qwen3_moe")
    }


def _hf_state(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, model.config


def _round_trip(state, layout):
    """HF -> every rank's shards -> gathered full Megatron tensors -> HF."""
    ranks = {
        (t, e): cv.shard_state(state, layout, t, e)
        for t in range(layout.tp)
        for e in range(layout.ep)
    }
    full_names = [n for n, _ in cv.hf_to_megatron(state, layout)]

    def get(name):
        for e in range(layout.ep):
            local = cv.local_name(name, layout, e)
            if local is not None:
                tp = layout.etp if local != name or ".experts." in name else layout.tp
                return cv.gather(name, [ranks[(t, e)][local] for t in range(tp)])
        raise KeyError(name)

    return dict(cv.megatron_to_hf(get, layout)), full_names, ranks


CASES = [
    ("qwen2", {"tp": 1}),
    ("qwen2", {"tp": 2}),
    ("llama", {"tp": 1}),
    ("llama", {"tp": 2}),
    ("qwen3", {"tp": 2}),
    ("qwen3_moe", {"tp": 1, "ep": 2}),
    ("qwen3_moe", {"tp": 2, "ep": 2, "etp": 2}),
    ("qwen3_moe", {"tp": 2, "ep": 2, "expert_naming": "grouped"}),
    ("qwen3", {"tp": 2, "fused_norms": True}),
]


@pytest.mark.parametrize(("arch", "opts"), CASES, ids=[f"{a}-{o}" for a, o in CASES])
def test_round_trip_is_exact(tiny_dirs, arch, opts):
    state, config = _hf_state(tiny_dirs[arch])
    layout = cv.GPTLayout.from_hf_config(config, **opts)
    back, full_names, ranks = _round_trip(state, layout)
    expected = {
        k: v for k, v in state.items() if not (layout.tie_word_embeddings and k == "lm_head.weight")
    }
    assert sorted(back) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name
    # Shard shapes: the embedding is vocab-padded and split; attention is split by whole groups.
    emb = ranks[(0, 0)]["embedding.word_embeddings.weight"]
    assert emb.shape == (layout.padded_vocab_size // layout.tp, layout.hidden_size)
    qkv = ranks[(0, 0)]["decoder.layers.0.self_attention.linear_qkv.weight"]
    rows = (layout.num_attention_heads + 2 * layout.num_key_value_heads) * layout.head_dim
    assert qkv.shape == (rows // layout.tp, layout.hidden_size)
    assert ("output_layer.weight" in full_names) == (not layout.tie_word_embeddings)
    if layout.num_experts:
        per_rank = layout.num_experts // layout.ep
        local = [k for k in ranks[(0, 1)] if ".experts." in k and k.startswith("decoder.layers.0.")]
        assert len(local) == 2 * per_rank


def test_per_expert_checkpoint_names_fold_into_fused_experts(tiny_dirs):
    from safetensors.torch import load_file

    disk = load_file(str(tiny_dirs["qwen3_moe"] / "model.safetensors"))
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in disk
    state, config = _hf_state(tiny_dirs["qwen3_moe"])
    layout = cv.GPTLayout.from_hf_config(config)
    from_disk = dict(cv.hf_to_megatron(disk, layout))
    from_memory = dict(cv.hf_to_megatron(state, layout))
    assert from_disk.keys() == from_memory.keys()
    for k in from_disk:
        assert torch.equal(from_disk[k], from_memory[k]), k


def _hand_layout(**kw):
    base = dict(
        arch="llama",
        num_layers=1,
        hidden_size=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=1,
        ffn_hidden_size=2,
        vocab_size=3,
        tie_word_embeddings=True,
        make_vocab_size_divisible_by=1,
    )
    base.update(kw)
    return cv.GPTLayout(**base)


def test_qkv_interleave_by_hand():
    # 4 query heads, 2 kv heads, head_dim 1: group g holds q heads 2g, 2g+1, then k_g, v_g.
    layout = _hand_layout()
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    k = torch.tensor([[10.0], [11.0]])
    v = torch.tensor([[20.0], [21.0]])
    state = {
        "model.embed_tokens.weight": torch.zeros(3, 1),
        "model.layers.0.input_layernorm.weight": torch.ones(1),
        "model.layers.0.self_attn.q_proj.weight": q,
        "model.layers.0.self_attn.k_proj.weight": k,
        "model.layers.0.self_attn.v_proj.weight": v,
        "model.layers.0.self_attn.o_proj.weight": torch.zeros(1, 4),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(1),
        "model.layers.0.mlp.gate_proj.weight": torch.tensor([[1.0], [2.0]]),
        "model.layers.0.mlp.up_proj.weight": torch.tensor([[3.0], [4.0]]),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(1, 2),
        "model.norm.weight": torch.ones(1),
    }
    full = dict(cv.hf_to_megatron(state, layout))
    qkv = full["decoder.layers.0.self_attention.linear_qkv.weight"].flatten().tolist()
    assert qkv == [0, 1, 10, 20, 2, 3, 11, 21]
    # TP 2: rank 0 holds group 0, rank 1 group 1.
    tp2 = _hand_layout(tp=2)
    r0 = cv.shard_state(state, tp2, 0)["decoder.layers.0.self_attention.linear_qkv.weight"]
    r1 = cv.shard_state(state, tp2, 1)["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert r0.flatten().tolist() == [0, 1, 10, 20]
    assert r1.flatten().tolist() == [2, 3, 11, 21]
    # Gated fc1: [gate; up] in full, [gate_r; up_r] per rank.
    assert full["decoder.layers.0.mlp.linear_fc1.weight"].flatten().tolist() == [1, 2, 3, 4]
    f0 = cv.shard_state(state, tp2, 0)["decoder.layers.0.mlp.linear_fc1.weight"]
    f1 = cv.shard_state(state, tp2, 1)["decoder.layers.0.mlp.linear_fc1.weight"]
    assert f0.flatten().tolist() == [1, 3]
    assert f1.flatten().tolist() == [2, 4]
    assert cv.gather("decoder.layers.0.mlp.linear_fc1.weight", [f0, f1]).flatten().tolist() == [
        1,
        2,
        3,
        4,
    ]
    # Vocab 3 padded to a multiple of TP (divisor 1): 4 rows, the last one zero.
    emb = full["embedding.word_embeddings.weight"]
    assert emb.shape == (3, 1)
    assert cv.shard_state(state, tp2, 1)["embedding.word_embeddings.weight"].shape == (2, 1)


def test_vocab_padding_default_divisor():
    layout = _hand_layout(
        vocab_size=1000, make_vocab_size_divisible_by=cv.DEFAULT_VOCAB_DIVISOR, tp=2
    )
    assert layout.padded_vocab_size == 1024
    assert _hand_layout(vocab_size=1024, make_vocab_size_divisible_by=128).padded_vocab_size == 1024


def test_layout_refuses_what_megatron_cannot_shard():
    with pytest.raises(ValueError, match="whole query groups"):
        _hand_layout(tp=4)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        _hand_layout(ep=2)
    with pytest.raises(ValueError, match="unsupported architecture"):
        _hand_layout(arch="gpt2")


def test_from_hf_config_reads_moe_fields(tiny_dirs):
    config = AutoConfig.from_pretrained(tiny_dirs["qwen3_moe"])
    layout = cv.GPTLayout.from_hf_config(config)
    assert layout.num_experts == config.num_experts > 0
    assert layout.qk_norm and not layout.qkv_bias
    assert all(layout.moe_layers)
    assert cv.GPTLayout.from_hf_config(AutoConfig.from_pretrained(tiny_dirs["qwen2"])).qkv_bias
