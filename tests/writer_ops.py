"""How the scenario builds the writer's operations: the typed ops of worker/ops.py (the recording was made with
the tuples that came before them)."""

from worker.ops import Command, End, Outputs, Publish, Start


class OPS:
    start = Start
    outputs = Outputs
    end = End
    publish = Publish
    command = Command
