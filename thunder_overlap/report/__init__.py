"""What a schedule is worth: the report of the final traces, its pictures and plots, the policy
comparison and the ``python -m thunder_overlap report`` command line."""
