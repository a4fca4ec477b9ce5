"""The pipeline that composes the components, and the ``goodput`` command line."""

PIPELINE_NAME = "goodput-train"
"""The pipeline's name in KFP (``pipelineInfo.name``) and the default name for ``goodput upload``."""
