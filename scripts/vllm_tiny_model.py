#!/usr/bin/env python3
"""Build a tiny random-weight Llama and its tokenizer, for running a real vLLM on a CPU.

    python vllm_tiny_model.py OUTDIR

No weights can be downloaded here, and a benchmark of the serving path needs none: the output
is gibberish, but the timing, batching, queueing, streaming and /metrics are vLLM's own.

Why each choice:
- Llama: the architecture every vLLM backend supports best, CPU included.
- hidden 1024, intermediate 2816, 8 layers, 16 heads, 4 KV heads: about 100 million
  parameters (200 MB in bf16), so that a decode step, which reads every weight, takes tens
  of milliseconds on two vCPUs and the engine, not the clients, is what a load saturates.
  (With hidden 256 and 2 layers a step took about 2.5 ms: 16 openai-python clients parsing
  their streams on the same two CPUs then could not keep more than about 5 requests in
  vLLM at once, and nothing ever queued.) Grouped-query attention (4 KV heads for 16 query
  heads) keeps the same KV-cache path as real models; head size 64 is one the CPU
  attention kernels accept.
- vocab 4096: small embedding and LM-head matrices, yet enough merges that English text
  takes about as many tokens as with a real tokenizer, so prompt lengths stay realistic.
- max_position_embeddings 8192: lets the server run with --max-model-len 8192.
- Byte-level BPE trained with `tokenizers` on the machine's own text (/usr/share/doc
  copyright files, the first few MB in sorted order): it encodes any input without unknown
  tokens, and the files are on every Debian host.
- bos <s> / eos </s> and a plain jinja chat template: /v1/chat/completions needs a template,
  and vLLM stops on the eos id that config.json and generation_config.json name.
- Seeded torch init and a sorted, size-capped corpus: two runs give the same model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 4096
CORPUS_BYTES = 4 << 20
BOS, EOS = "<s>", "</s>"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus(limit: int = CORPUS_BYTES) -> list[str]:
    """The text of /usr/share/doc's copyright files, sorted by path, up to `limit` bytes."""
    texts: list[str] = []
    size = 0
    for path in sorted(Path("/usr/share/doc").glob("**/copyright")):
        if size >= limit or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        size += len(text)
    if not texts:
        sys.exit("vllm_tiny_model: no text found under /usr/share/doc")
    return texts


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[BOS, EOS],  # ids 0 and 1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    # A plain prompt (/v1/completions) starts with <s>; the chat template writes its own.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, chat_template=CHAT_TEMPLATE
    )


def build_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.bfloat16)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: vllm_tiny_model.py OUTDIR")
    out = Path(sys.argv[1])
    tokenizer = build_tokenizer()
    build_model(tokenizer).save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"vllm_tiny_model: wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
