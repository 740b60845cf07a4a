"""Progress, hangs and stragglers, the trainer's side: each process reports its steps and
phases (:func:`report_steps`, :func:`phase`; the checkpoint manager and the framework
integrations do it for their loops), its node's agent reads the reports (:func:`read_node`)
and sends them with its heartbeats, and takes a hung process's stacks (:func:`take_stacks`)
before stopping it.

Runs in every worker (the reporter) and in the agent (the reading, the stacks).
"""

from ._record import PROGRESS_ENV, Record, Starvation, read_node, read_record, records, write_record
from ._reporter import StepReporter, follow, phase, report_steps, reporter, waiting
from ._stacks import STACKS_SIGNAL, Stacks, stacks_file, take_stacks

__all__ = [
    "PROGRESS_ENV",
    "STACKS_SIGNAL",
    "Record",
    "Stacks",
    "Starvation",
    "StepReporter",
    "follow",
    "phase",
    "read_node",
    "read_record",
    "records",
    "report_steps",
    "reporter",
    "stacks_file",
    "take_stacks",
    "waiting",
    "write_record",
]
