"""Reading a trace: what each bound symbol is (classification), the model's blocks, how long ops
and collectives take (cost model), how much memory a trace holds (estimate), and what a schedule
would cost end to end (simulator). Nothing here changes a trace."""
