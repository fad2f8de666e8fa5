"""The job spec: one YAML file that states everything a run depends on.

job.py holds `JobSpec` and `load_spec`; the sections are in sections.py (model, optimizer, training,
stages, resources, costs), data.py, data_instruct.py and data_predictive.py (the `data` section),
finetune.py and predictive.py (objectives and the table and image families). checks.py holds the
whole-spec checks, paths.py the field paths errors name, reference.py the generated reference and JSON
Schema, templates.py the starting specs of `runyard spec init`, diff.py what an edited spec changes
against a run directory's, seeds.py every seed derived from the spec's `seed`. Imports pydantic, never
torch.
"""
