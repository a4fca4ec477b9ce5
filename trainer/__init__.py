"""The code that runs inside the training pods: model, data, loop, checkpoints, restart hooks.

It never imports kfp or Kubernetes clients.
"""
