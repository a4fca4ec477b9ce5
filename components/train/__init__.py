"""The check-settings and train steps: the run's settings checked and recorded (``settings``), the training
job built (``pytorchjob``, ``trainjob``, ``kueue``, ``peer_secret``), launched and supervised to its end
(``launch``, ``supervise``, ``progress``), and removed with the run (``cleanup``). Each ``*_op`` module is the
KFP component of the module it is named after; ``launch`` holds its own (``train_op``)."""
