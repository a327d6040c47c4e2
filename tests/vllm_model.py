"""Builds the tiny model tests/vllm_server.py serves, run by vLLM's own interpreter
(``python vllm_model.py DIR``): a Llama of 2 layers, hidden size 64 and head size 32 (the
CPU backend's smallest), random weights from a fixed seed, a byte-level BPE tokenizer trained
here on a few sentences, and a chat template that renders tools, tool calls and tool results
the way Hermes-style models do (``<tool_call>`` … ``</tool_call>``, which vLLM's ``hermes``
parser needs in the vocabulary). Nothing is downloaded; it takes a few seconds.

The model answers every turn with one sentence (``answer_in_turns``), and vLLM counts every
token it is fed: the tests compare ``usage.input_tokens``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{%- if message.content %}
{{ message.content }}
{%- endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": \
{{ call.function.arguments if call.function.arguments is string else call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>"]
CORPUS = [
    "The weather in Paris is sunny and warm today; in Berlin it rains.",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "You are a helpful assistant. Answer briefly, and call a tool when you need one.",
    "user assistant system tool developer function call output message",
    "What is the temperature in Berlin? Call the tool please, then tell me.",
    "0123456789 {}[]\":,._-",
]


def build(directory: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|endoftext|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=8192,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                         pad_token_id=fast.pad_token_id, tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(config)
    answer_in_turns(model, fast)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": fast.eos_token_id}))


ANSWER = "The weather is sunny."


def answer_in_turns(model, tokenizer) -> None:
    """Make every answer ``ANSWER`` and its end: the layers add nothing (their
    output projections zero), so each next token is read off the last one's
    embedding alone, and the unembedding maps the generation prompt's last
    token to the answer's first, each of its tokens to the next, the last to
    the end of the turn. Answers then complete (a random model would run to
    its token limit, and an incomplete answer is continued from by no one)."""
    import torch

    prompt_end = tokenizer("<|im_start|>assistant\n")["input_ids"][-1]
    chain = [prompt_end, *tokenizer(ANSWER)["input_ids"], tokenizer.eos_token_id]
    assert len(set(chain)) == len(chain), chain
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embeddings, unembedding = model.model.embed_tokens.weight, model.lm_head.weight
        for before, after in zip(chain, chain[1:]):
            unembedding[after] = 10 * embeddings[before] / embeddings[before].norm()


if __name__ == "__main__":
    build(Path(sys.argv[1]))
