"""`keel inspect` on a family keel does not know: the tensors it could place by role, the ones it could
not, and the metadata keys it does not read, then a one-line error (HF and GGUF)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

from keel.cli import main


def inspect(capsys, path, *extra):
    code = main(["inspect", str(path), *extra])
    out, err = capsys.readouterr()
    return code, out, err


def test_an_unknown_hf_family_is_surveyed(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    config = transformers.DiffLlamaConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    transformers.DiffLlamaForCausalLM(config).save_pretrained(tmp_path)
    capsys.readouterr()  # transformers' own progress bar
    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.rotary_slopes"] = torch.zeros(2)  # a tensor of no role in keel's block
    save_file(tensors, weights, metadata={"format": "pt"})
    code, out, err = inspect(capsys, tmp_path)
    assert code == 1
    assert err.count("\n") == 1 and "unsupported HF architecture DiffLlamaForCausalLM" in err
    lines = out.splitlines()
    assert "  attention  model.layers.N.self_attn.lambda_q1  x2  new" in lines  # differential attention's
    assert "  attention  model.layers.N.self_attn.q_proj.weight  x2" in lines  # keel's own name: not new
    assert "  embedding  model.embed_tokens.weight" in lines
    unplaced = lines[lines.index("tensors keel could not place:") + 1 :]
    assert "  model.rotary_slopes" in unplaced
    keys = out.split("metadata keys keel does not read:")[1]
    assert "lambda_std_dev" in keys and "vocab_size" not in keys


def test_an_unknown_gguf_architecture_is_surveyed(tmp_path, capsys):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "refact")
    writer.add_block_count(1)
    writer.add_context_length(32)
    writer.add_causal_attention(True)
    for name in ("token_embd.weight", "position_embd.weight", "blk.0.attn_qkv.weight", "blk.0.ffn_up.weight"):
        writer.add_tensor(name, np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    code, out, err = inspect(capsys, path, "--json")
    assert code == 1 and "unsupported GGUF architecture 'refact'" in err
    import json

    survey = json.loads(out)
    assert survey["placed"]["attention"] == {"blk.N.attn_qkv.weight": 1}
    assert survey["placed"]["mlp"] == {"blk.N.ffn_up.weight": 1}
    assert survey["unplaced"] == {"position_embd.weight": 1}
    assert survey["unread_keys"] == ["refact.attention.causal"]  # context_length and block_count are read


@pytest.mark.parametrize("name", ["llama", "gpt_neox"])
def test_a_known_family_is_inspected_as_before(tmp_path, capsys, name):
    from tiny_models import save_hf_model

    save_hf_model(name, tmp_path)
    capsys.readouterr()
    code, out, _ = inspect(capsys, tmp_path)
    assert code == 0 and "no keel family reads it" not in out and f'"{name}"' in out
