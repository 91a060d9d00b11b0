"""The stages as Prefect tasks: thin orchestration and tracking around the plain measurement
code of each stage package (one wrapper module per stage; shared parts in ``common``)."""

from tasks.pipeline.profile import ProfileSweepFailed, profile_stage
from tasks.pipeline.stream import stream_stage
from tasks.pipeline.sweep import sweep_stage
from tasks.pipeline.tokenize import tokenize_stage

__all__ = ["ProfileSweepFailed", "profile_stage", "stream_stage", "sweep_stage", "tokenize_stage"]
