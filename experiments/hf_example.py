"""A Hugging Face model running its attention through sparseflash (no weights are fetched).

    pip install 'sparseflash[hf]'
    python -m sparseflash.experiments.hf_example [--model llama|bert] [--pattern local:window=32] [--device cuda]

Builds a tiny randomly initialised Llama (causal, grouped-query heads) or BERT (bidirectional)
from a config, registers sparseflash attention twice (dense, and with ``--pattern``), and checks on
a right-padded batch: dense sparseflash logits equal transformers' eager attention; the patterned
model equals eager attention given the same pattern as an explicit 4-D mask. For Llama it also
generates a few tokens greedily with a KV cache (dense) and compares them with eager's.
"""

from __future__ import annotations


import torch

from sparseflash.cmdline import ArgumentParser, positive_int, run_command

import sparseflash.hf
from sparseflash.experiments.lra.model import parse_pattern_spec


def build(kind: str, device):
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        return LlamaForCausalLM(cfg).to(device).eval(), True
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=512)
    return BertModel(cfg).to(device).eval(), False


def run(model, impl, ids, attention_mask):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        out = model(ids, attention_mask=attention_mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def main(argv=None):
    ap = ArgumentParser(prog="python -m sparseflash.experiments.hf_example", description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("llama", "bert"), default="llama")
    ap.add_argument("--pattern", default="local:window=32", help="a sparseflash.patterns spec, name:key=value,...")
    ap.add_argument("--block-size", type=positive_int, default=16)
    ap.add_argument("--seq-len", type=positive_int, default=200)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    device = torch.device(args.device)
    model, causal = build(args.model, device)
    name, kwargs = parse_pattern_spec(args.pattern)
    if causal and "causal" in kwargs:
        kwargs.pop("causal")
    sparseflash.hf.register("blocksparse", block_size=args.block_size)
    fn = sparseflash.hf.register("blocksparse-pattern", pattern=name, pattern_kwargs=kwargs, block_size=args.block_size)

    n = args.seq_len
    ids = torch.randint(1, 101, (3, n), device=device)
    lengths = torch.tensor([n, n - 37, n // 3], device=device)
    pad = (torch.arange(n, device=device)[None, :] < lengths[:, None]).long()
    valid = pad.bool()
    eager = run(model, "eager", ids, pad)
    dense = run(model, "blocksparse", ids, pad)
    print(f"{args.model}: dense sparseflash vs eager, max |diff| over real tokens: "
          f"{(dense - eager)[valid].abs().max().item():.2e}")

    patterned = run(model, "blocksparse-pattern", ids, pad)
    mask = next(iter(fn.masks.values()))
    # The same function in eager attention: the pattern (and causal, padding) as an explicit additive mask.
    allowed = mask.to_dense()[:, :1] & valid[:, None, None, :]
    if causal:
        allowed = allowed & torch.ones(n, n, dtype=torch.bool, device=device).tril()
    additive = torch.zeros(allowed.shape, device=device).masked_fill(~allowed, torch.finfo(torch.float32).min)
    eager_pattern = run(model, "eager", ids, additive)
    print(f"pattern {args.pattern} (block {args.block_size}, {mask.density():.2f} of the blocks): "
          f"max |diff| vs eager with the same mask: {(patterned - eager_pattern)[valid].abs().max().item():.2e}; "
          f"vs dense: {(patterned - eager)[valid].abs().max().item():.2e}")

    if causal:
        prompt = ids[:1, :20]
        outs = {}
        for impl in ("eager", "blocksparse"):
            model.set_attn_implementation(impl)
            with torch.no_grad():
                outs[impl] = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        print(f"greedy generation with a KV cache, 8 tokens: same as eager: {torch.equal(outs['eager'], outs['blocksparse'])}")


if __name__ == "__main__":
    raise SystemExit(run_command(main))
