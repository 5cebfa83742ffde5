"""The scheduler: which requests run this step and on how many tokens, its
one-step-ahead half, and the SchedulerOutput it hands the model runner."""
