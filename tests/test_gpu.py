"""On a CUDA machine: the torch path on device="cuda" still matches Hugging Face, token
for token (fp32, TF32 off), on the same 20 prompts as the CPU test. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from hf_reference import hf_greedy
from prompts import CHAT, LONG_CHAT, LONG_RAW, RAW
from transformers import AutoModelForCausalLM

from tandem import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
NEW_TOKENS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def no_tf32():  # noqa: ANN201
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_cuda_matches_hugging_face(smollm2_path) -> None:  # noqa: ANN001
    llm = LLM("smollm2-135m-instruct", device="cuda", dtype="float32")
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}])
               for c in CHAT + [LONG_CHAT]] + [tok.encode(r) for r in RAW + [LONG_RAW]]
    hf = AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    ).to("cuda").eval()
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    alone = [llm.generate(p, GREEDY)[0].token_ids for p in prompts]
    batched = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    mismatches = [i for i, (a, e) in enumerate(zip(alone, expected)) if a != e]
    assert not mismatches, f"alone: prompts {mismatches} differ"
    mismatches = [i for i, (b, e) in enumerate(zip(batched, expected)) if b != e]
    assert not mismatches, f"batched: prompts {mismatches} differ"
