"""The pipeline that composes the components, and the ``goodput`` command line."""
