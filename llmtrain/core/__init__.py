"""The leaf of the package: what every other package may use, importing nothing else of llmtrain.
The errors (`errors`), the run dir's file names and record kinds (`files`) and its job log (`rundir`),
atomic writes (`atomic`), judged items and their renderers (`findings`), files that may be hostile read
within bounds (`readers`), a Hugging Face folder's file names (`hf_files`), the console every command
prints through (`console`) and the test-only fault hooks (`faults`)."""
