"""What a run leaves behind and the commands that read it: report, compare, sample, export."""
