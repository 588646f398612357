from rlaif.cli import entry

entry()
