"""The door between the engine and its model runners: one in this process
(UniProcExecutor), or one per expert-parallel rank, each in a process of its
own (MultiprocExecutor)."""
