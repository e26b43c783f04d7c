"""What the placement tests share: prompts, one routed run in a comparable form, and a pid check."""
from __future__ import annotations

import math
import os

PROMPTS = ["def add(a, b):", "hello", "The quick brown fox", "x" * 40, "Once upon a time", "import os\n",
           "Q: 2+2?", "SELECT * FROM t WHERE", "<html>", "fn main() {", "1, 2, 3,", "Dear Sir,", "# TODO",
           "while True:", "lorem ipsum dolor", "print(", "a = [1,", "class Foo:", "// c", "$ ls"]

# config/tiny/pair.yaml's models with the large one split over two ranks
TP_LARGE = [{"name": "small", "source": "tiny:qwen2-small", "block_size": 4, "num_kv_blocks": 512, "max_model_len": 1024},
            {"name": "large", "source": "tiny:qwen2-large", "block_size": 4, "num_kv_blocks": 512, "max_model_len": 1024,
             "tensor_parallel_size": 2}]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def run(svc, policy: str, concurrency: int):
    """`concurrency + 4` requests of different lengths: per request its tokens, models, scores, finish."""
    requests = [{"prompt": p, "max_tokens": 5 + 3 * (i % 4)} for i, p in enumerate(PROMPTS[:concurrency + 4])]
    outs = svc.generate_batch(requests, concurrency=concurrency, policy=policy)
    return [(o.token_ids, [r.model for r in o.tokens], [None if math.isnan(r.score) else round(r.score, 5)
                                                         for r in o.tokens], o.finish_reason) for o in outs]
