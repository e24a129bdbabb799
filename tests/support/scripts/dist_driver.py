"""Run several mtrain scenarios in one `torchrun` launch (start-up costs 6-10 s, so tests group their checks).

    torchrun --standalone --nproc-per-node 2 tests/support/scripts/dist_driver.py SPEC.json

SPEC.json is a list of scenarios: {"cli": [args of the `mtrain` command]} runs the command line in-process;
{"config": {raw config}, "out": "result.json"} runs the Trainer and has rank 0 write its losses and the lines it
printed; with "record": "prefix" every rank also saves its gradients at the steps in "grads_at" and its final
weights to prefix.rank{R}.pt (see tests/mtrain/recording.py). A scenario that should fail gives "error":
"result.json": rank 0 writes the message of the TrainError it raised. "compile_backend": "aot_eager" makes
train.compile use that backend.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from mconvert.workers import end_process_group, init_process_group  # noqa: E402
from mtrain.cli import main  # noqa: E402
from mtrain.config import from_dict  # noqa: E402
from mtrain.errors import TrainError  # noqa: E402
from mtrain.train import Trainer  # noqa: E402
from tests.mtrain.recording import RecordingTrainer  # noqa: E402
from tests.support.gloo_threads import gloo_threads  # noqa: E402


def run(spec: dict) -> None:
    if "compile_backend" in spec:  # e.g. aot_eager: Dynamo and AOT autograd without inductor's slow CPU codegen
        import torch

        compile_module = torch.nn.Module.compile
        backend = spec["compile_backend"]
        torch.nn.Module.compile = lambda self, **kw: compile_module(self, backend=backend)
    if "cli" in spec:
        main(spec["cli"], standalone_mode=False)
        return
    if "error" in spec:
        try:
            Trainer(from_dict(spec["config"])).run()
            message = None
        except TrainError as e:
            message = str(e)
        if dist.get_rank() == 0:
            Path(spec["error"]).write_text(json.dumps({"error": message}))
        return
    lines: list[str] = []  # what rank 0 printed (the Trainer runs)
    if "record" in spec:
        trainer = RecordingTrainer(from_dict(spec["config"]), grads_at=tuple(spec.get("grads_at", ())))
        result, _ = trainer.run_and_record(Path(f"{spec['record']}.rank{dist.get_rank()}.pt"))
    else:
        result = Trainer(from_dict(spec["config"]), out=lambda line: print(line) or lines.append(line)).run()
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps({"losses": result.losses, "valid": result.valid_losses,
                                                 "checkpoints": [str(p) for p in result.checkpoints],
                                                 "lines": lines}))


if __name__ == "__main__":
    init_process_group("gloo")  # as mtrain's own start does
    try:
        for scenario in json.loads(Path(sys.argv[1]).read_text()):
            run(scenario)
    finally:
        end_process_group()  # as mtrain's own end does
    if gloo_threads():  # left running, one of them can abort the process while the interpreter shuts down
        sys.exit(f"rank {os.environ.get('RANK')}: {gloo_threads()} gloo threads outlived the process groups")
