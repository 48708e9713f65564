"""Before a run: the pre-flight checklist (`llmtrain check`) and the memory/time estimate."""
