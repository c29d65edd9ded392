"""Greedy chat replies from vLLM, for ``tests/test_serving.py``: run by a Python that has vLLM
(``RECIPES_VLLM_PYTHON``; vLLM cannot share this project's environment), never imported.

    python tests/vllm_chat.py <final/> conversations.json replies.json

writes, per conversation, the prompt ids vLLM rendered with the folder's chat template and the
ids of its greedy reply (16 tokens at most, its stop token included), in fp32.
"""

import json
import sys


def main() -> None:
    from vllm import LLM, SamplingParams

    folder, conversations, out = sys.argv[1:4]
    with open(conversations) as f:
        messages = json.load(f)
    llm = LLM(model=folder, dtype="float32", max_model_len=256, enforce_eager=True)
    replies = llm.chat(messages, SamplingParams(temperature=0, max_tokens=16))
    rows = [
        {"prompt_ids": r.prompt_token_ids, "ids": list(r.outputs[0].token_ids)} for r in replies
    ]
    with open(out, "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":  # vLLM spawns its engine process, which imports this file again
    main()
