"""A tiny LLaVA (CLIP vision tower + 2-layer Llama) and its processor, built in code, for the VLM conformance test.

Character-level tokenizer with an ``<image>`` token, the CLIP image processor's PIL backend (no torchvision) at
28x28 pixels (4 patches of 14), and a minimal chat template that renders image parts as ``<image>``. Nothing is
downloaded.
"""

from __future__ import annotations

import numpy as np
from chat_helpers import CHAT_CHARS

VLM_SPECIALS = ["<pad>", "<s>", "</s>", "<image>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_vlm(path: str) -> None:
    """Save a tiny ``LlavaForConditionalGeneration`` and its ``LlavaProcessor`` to ``path``."""
    import torch
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )
    from transformers.models.clip import CLIPImageProcessorPil

    vocab = {t: i for i, t in enumerate(["<unk>", *VLM_SPECIALS, *CHAT_CHARS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VLM_SPECIALS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        bos_token="<s>",
        unk_token="<unk>",
        padding_side="left",
    )
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    torch.manual_seed(0)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
            projection_dim=16,
        ),
        text_config=LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
        ),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    model = LlavaForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.save_pretrained(path)
    processor.save_pretrained(path)


def image_dataset(n_rows: int = 8, seed: int = 0):
    """Conversational prompts with one random 28x28 RGB image each (trl's ``image`` column)."""
    from datasets import Dataset
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 256, (28, 28, 3), dtype=np.uint8)) for _ in range(n_rows)]
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color is it?"}]}]
    return Dataset.from_dict({"prompt": [prompt] * n_rows, "image": images})
