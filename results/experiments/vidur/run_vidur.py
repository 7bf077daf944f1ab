"""Run Vidur's simulator (microsoft/vidur, in its own environment) and write what servetune's replay needs.

    python run_vidur.py FIXTURE.csv BATCHES.csv [vidur.main's flags ...]

Vidur's own request_metrics.csv reports prompt and output lengths as they stand when a request ends, and a request
restarted after a KV-cache eviction has its decoded tokens moved into its prompt, so the lengths it was generated
with are read here before the run. FIXTURE.csv has one row per request: arrival (s), the generated prompt and
output tokens, Vidur's TTFT (its prefill completion, which emits one token), TPOT and E2EL, and its restarts,
under a header naming the Vidur commit, the command and Vidur's KV block count. BATCHES.csv has one row per
batch Vidur priced: its shape in servetune's StepBatch terms, so the same batches can be priced by servetune's
cost model, and Vidur's model time and the parts of it (ms per layer, as Vidur's ExecutionTime holds them)."""
import csv
import subprocess
import sys
from pathlib import Path

import vidur

from vidur.config import SimulationConfig
from vidur.scheduler.replica_stage_scheduler.replica_stage_schduler import ReplicaStageScheduler
from vidur.simulator import Simulator
from vidur.utils.random import set_seeds

BATCH_FIELDS = ["num_prefill_seqs", "prefill_tokens", "prefill_context_tokens", "prefill_attention_pairs",
                "prefill_causal_pairs", "num_decode_seqs", "decode_context_tokens", "model_time_s", "total_time_s",
                "attn_decode_ms", "attn_prefill_ms", "mlp_layer_ms", "attention_layer_ms", "all_reduce_ms"]


def batch_row(batch, execution_time):
    """The batch's shape read before Vidur's on_batch_end advances its requests: a request still in prefill
    contributes a chunk of q tokens after c computed ones, any other one decode token after c."""
    row = dict.fromkeys(BATCH_FIELDS[:7], 0)
    for request, q in zip(batch.requests, batch.num_tokens):
        c = request.num_processed_tokens
        if request.is_prefill_complete:
            # Vidur counts the token its prefill emitted as processed, so c already includes the token this
            # decode computes: it attends to c tokens, servetune's (c + 1) with c the tokens whose KV exists.
            row["num_decode_seqs"] += 1
            row["decode_context_tokens"] += c
        else:
            row["num_prefill_seqs"] += 1
            row["prefill_tokens"] += q
            row["prefill_context_tokens"] += c + q
            row["prefill_attention_pairs"] += q * (c + q / 2)
            row["prefill_causal_pairs"] += q * q / 2
    e = execution_time
    row.update(model_time_s=e.model_time, total_time_s=e.total_time,
               attn_decode_ms=e.attention_decode_execution_time, attn_prefill_ms=e.attention_prefill_execution_time,
               mlp_layer_ms=e._get_mlp_layer_execution_time(), attention_layer_ms=e._get_attention_layer_execution_time(),
               all_reduce_ms=e.attention_all_reduce_time)
    return row


def main() -> None:
    fixture_out, batches_out = sys.argv[1], sys.argv[2]
    del sys.argv[1:3]  # the rest are vidur.main's own flags
    config = SimulationConfig.create_from_cli_args()
    set_seeds(config.seed)  # as vidur.main does
    batches = []
    on_schedule = ReplicaStageScheduler.on_schedule

    def recording_on_schedule(self):
        batch, stage, execution_time = on_schedule(self)
        if batch is not None:
            batches.append(batch_row(batch, execution_time))
        return batch, stage, execution_time

    ReplicaStageScheduler.on_schedule = recording_on_schedule
    simulator = Simulator(config)
    requests = sorted((event._request for _, event in simulator._event_queue), key=lambda r: r.arrived_at)
    generated = {r.id: (r.num_prefill_tokens, r.num_decode_tokens) for r in requests}
    replica = simulator.scheduler.get_replica_scheduler(0)
    # Vidur sizes its KV cache itself (MemoryPlanner); servetune's replay can be given the same count.
    print(f"vidur num_blocks {replica._config.num_blocks}, block_size {replica._config.block_size}, "
          f"max batch size {replica._max_batch_size}")
    simulator.run()
    vidur_dir = Path(list(vidur.__path__)[0]).resolve().parent   # a namespace package: no __file__
    commit = subprocess.run(["git", "-C", str(vidur_dir), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    with open(fixture_out, "w", newline="") as f:
        f.write(f"# vidur: microsoft/vidur @ {commit}, simulated by its own code (MIT licence, ATTRIBUTION.md)\n"
                f"# command: python results/experiments/vidur/run_vidur.py FIXTURE BATCHES {' '.join(sys.argv[1:])}\n"
                f"# vidur_num_blocks: {replica._config.num_blocks}\n"
                f"# vidur_block_size: {replica._config.block_size}\n"
                "# columns: arrival (s), the generated prompt and output tokens, Vidur's TTFT (its prefill completion,\n"
                "#   which emits the first token), TPOT ((E2EL - TTFT) / (output - 1), empty for one-token answers),\n"
                "#   E2EL, all in seconds, and the request's restarts (KV evictions)\n")
        w = csv.writer(f)
        w.writerow(["arrival_s", "prompt_tokens", "output_tokens", "ttft_s", "tpot_s", "e2el_s", "restarts"])
        for r in requests:
            p, o = generated[r.id]
            ttft, e2el = r.prefill_completed_at - r.arrived_at, r.completed_at - r.arrived_at
            tpot = f"{(e2el - ttft) / (o - 1):.6f}" if o > 1 else ""
            w.writerow([f"{r.arrived_at:.6f}", p, o, f"{ttft:.6f}", tpot, f"{e2el:.6f}", r.num_restarts])
    with open(batches_out, "w", newline="") as f:
        w = csv.DictWriter(f, BATCH_FIELDS)
        w.writeheader()
        w.writerows(batches)
    print(f"{len(requests)} requests, {len(batches)} batches; Vidur's own metrics in {config.metrics_config.output_dir}")


if __name__ == "__main__":
    main()
