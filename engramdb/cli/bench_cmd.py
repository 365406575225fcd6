"""placeholder"""
import click
@click.command("bench")
def bench_cmd() -> None:
    """x"""
