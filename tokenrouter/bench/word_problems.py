"""Templates of arithmetic word problems: each draws its numbers from a seeded `random.Random` and returns
the question and its exact answer."""
from __future__ import annotations

import random

NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jo")


def shopping(rng: random.Random) -> tuple[str, float]:
    name, a, pa, b, pb = rng.choice(NAMES), rng.randint(2, 9), rng.randint(2, 15), rng.randint(2, 9), rng.randint(2, 15)
    paid = (a * pa + b * pb) // 10 * 10 + 10 * rng.randint(1, 3)
    return (f"{name} buys {a} notebooks at ${pa} each and {b} pens at ${pb} each, and pays with ${paid}. "
            f"How many dollars of change does {name} get?", paid - a * pa - b * pb)


def travel(rng: random.Random) -> tuple[str, float]:
    speed, hours, stop, speed2 = rng.randint(40, 90), rng.randint(2, 5), rng.randint(1, 3), rng.randint(30, 70)
    return (f"A train travels at {speed} km/h for {hours} hours, stops, then travels at {speed2} km/h for "
            f"{stop} more hours. How many kilometres does it travel in total?", speed * hours + speed2 * stop)


def ages(rng: random.Random) -> tuple[str, float]:
    name, other = rng.sample(NAMES, 2)
    child, factor, years = rng.randint(4, 15), rng.randint(2, 4), rng.randint(2, 10)
    return (f"{name} is {factor} times as old as {other}. {other} is {child} years old. How old will "
            f"{name} be in {years} years?", child * factor + years)


def percent(rng: random.Random) -> tuple[str, float]:
    price, off, tax = rng.randint(4, 40) * 10, rng.choice((10, 20, 25, 30, 50)), rng.choice((5, 10, 20))
    discounted = price * (100 - off) / 100
    return (f"A jacket costs ${price}. It is discounted by {off}%, and then a {tax}% sales tax is added to the "
            f"discounted price. What is the final price in dollars?", round(discounted * (100 + tax) / 100, 4))


def work_rate(rng: random.Random) -> tuple[str, float]:
    per_hour, workers, hours, done = rng.randint(3, 12), rng.randint(2, 6), rng.randint(2, 8), rng.randint(5, 30)
    return (f"Each worker assembles {per_hour} chairs per hour. {workers} workers work for {hours} hours, and "
            f"{done} of the chairs turn out broken. How many good chairs are made?", per_hour * workers * hours - done)


def sharing(rng: random.Random) -> tuple[str, float]:
    friends, boxes, per_box, eaten = rng.randint(3, 8), rng.randint(2, 6), rng.randint(6, 24), rng.randint(1, 5)
    total = boxes * per_box - eaten
    total -= total % friends
    boxes_per = (total + eaten) / per_box
    if boxes_per != int(boxes_per):
        return sharing(rng)
    return (f"There are {int(boxes_per)} boxes with {per_box} cookies each. {eaten} cookies are eaten, and the "
            f"rest are shared equally among {friends} friends. How many cookies does each friend get?",
            total // friends)


def savings(rng: random.Random) -> tuple[str, float]:
    name, start, weekly, weeks, spend = rng.choice(NAMES), rng.randint(10, 100), rng.randint(5, 25), \
        rng.randint(3, 12), rng.randint(5, 40)
    return (f"{name} has ${start} saved, adds ${weekly} every week for {weeks} weeks, and then spends ${spend} "
            f"on a game. How many dollars does {name} have left?", start + weekly * weeks - spend)


def area(rng: random.Random) -> tuple[str, float]:
    length, width, tile = rng.randint(3, 12), rng.randint(3, 12), rng.choice((2, 4, 5))
    return (f"A room is {length} m long and {width} m wide. One box of tiles covers {tile} square metres. "
            f"How many boxes are needed to cover the floor? (Boxes cannot be split.)",
            -(-length * width // tile))


TEMPLATES = (shopping, travel, ages, percent, work_rate, sharing, savings, area)
