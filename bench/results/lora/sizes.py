"""Weight-sync bytes of a LoRA adapter against the full model, in the sync's own wire format (build_manifest):
the built-in tiny model's shape and the 0.25b chat shape (flashrl/models/chat_model.py SIZES). Run from the repo root:
`.venv/bin/python bench/results/lora/sizes.py`."""

from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from flashrl.trainer.lora import LoraSpec, adapter_state_dict, apply_lora
from flashrl.wire.weights import build_manifest, manifest_nbytes


def meas(name, mk, specs):
    m = mk()
    full = manifest_nbytes(build_manifest(m.state_dict(), 1, bucket_mb=512)[0])
    for s in specs:
        p = apply_lora(mk(), s)
        a = manifest_nbytes(build_manifest(adapter_state_dict(p), 1, bucket_mb=512)[0])
        print(f"{name}: full {full/2**20:.2f} MiB; rank {s.rank} on {','.join(s.target_modules) if len(s.target_modules)<7 else 'all 7'}: {a/2**10:.1f} KiB = {100*a/full:.2f}%")
def tiny():
    return LlamaForCausalLM(LlamaConfig(vocab_size=91, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=512, tie_word_embeddings=True))
meas("tiny", tiny, [LoraSpec(16, 32), LoraSpec(8, 16), LoraSpec(4, 8), LoraSpec(16, 32, target_modules=("q_proj", "v_proj"))])

def big():
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=32768, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8, head_dim=64, intermediate_size=3072, tie_word_embeddings=False))
meas("0.25b", big, [LoraSpec(16, 32), LoraSpec(64, 128)])
