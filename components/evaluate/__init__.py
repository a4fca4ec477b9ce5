"""The evaluate and register steps: every committed checkpoint scored (``evaluate``, with lm-evaluation-harness
tasks from ``tasks``), the report (``report``), the promotion decision, and the promoted model written to a
registry directory or S3 (``register``) or MLflow (``mlflow_registry``). Each ``*_op`` module is the KFP
component of the module it is named after."""
