"""The stage steps: a dataset from S3 (or a directory) to FSx, tokenized into shards (``dataset``, fanned out
over pods by ``plan_op``, ``partition_op`` and ``merge_op``), and an ``init_from`` model copied to FSx
(``model``). Each ``*_op`` module is the KFP component of the module it is named after."""
