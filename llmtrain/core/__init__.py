"""The leaf of the package: what every other package may use and which imports nothing of llmtrain
but `errors`: reading files that may be hostile (`readers`)."""
