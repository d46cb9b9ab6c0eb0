"""torch_ce inside other trainers: ``torch_ce.integrations.torchtitan`` (torchtitan's
graph_trainer, ``--compile.pass_pipeline torch_ce``)."""
