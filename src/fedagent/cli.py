"""Command-line interface (placeholder until the daemons land)."""
import click


@click.group()
def main() -> None:
    """fedagent: federated learning at the edge."""
