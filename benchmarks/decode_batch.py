"""Batch decode through the executor: 64 random prompts (50-300 tokens), 64 greedy tokens each.

Reports output tokens/s and the median 64-sequence decode step (from iteration stats).

    python benchmarks/decode_batch.py ENGINE_DIR   # an engine built with --max_batch_size 64
"""
import time, torch, random, sys
from kiln.runtime.executor import Executor, ExecutorConfig, Request
from kiln.runtime.sampling_params import SamplingParams
torch.set_num_threads(2)
ex = Executor(sys.argv[1], ExecutorConfig(max_batch_size=64))
rng = random.Random(0)
reqs = [Request(input_token_ids=[rng.randrange(1000, 40000) for _ in range(rng.randrange(50, 300))], max_tokens=64,
                sampling_config=SamplingParams(temperature=0, ignore_eos=True)) for _ in range(64)]
ids = ex.enqueue_requests(reqs)
done = 0; t = time.perf_counter()
while done < len(ids):
    done += sum(1 for r in ex.await_responses(ids, timeout=60) if r.result.is_final)
el = time.perf_counter() - t
stats = ex.get_latest_iteration_stats()
dec = sorted(s.step_ms for s in stats if s.num_scheduled_tokens == 64)
print(f"total {el:.1f}s, {64*64/el:.1f} out tok/s, decode step median {dec[len(dec)//2]:.0f} ms over {len(dec)} steps")
ex.shutdown()
