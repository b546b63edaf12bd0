# plot.gp — the benchmark's chart (gnuplot; run by `./launch/tpnorm bench --plot`).
# Variables from -e: rows (the rows CSV), proj (the projection CSV), out (the PNG).
# Left: measured time per phase (and the bare all-reduce and the fitted model, dashed) against
# world size, one colour per series, one point type per op. Right: projected communication
# time per step (model) to 1024 ranks, one colour per link model, one dash type per op. The rows are read sorted by op, so each op's points are adjacent
# and its line is not broken by the other ops' rows.
set terminal pngcairo size 1500,600 font ",10" noenhanced
set output out
set datafile separator ","
set multiplot layout 1,2 title "tpnorm bench: communication cost of sharded norms (time per forward + backward step)"

ops = system("tail -n +2 '".rows."' | cut -d, -f2 | awk '!s[$0]++' | tr '\\n' ' '")
models = system("tail -n +2 '".proj."' | cut -d, -f2 | awk '!s[$0]++' | tr '\\n' ' '")
by_op = "< tail -n +2 '".rows."' | sort -t, -k2,2 -k1,1n"
phases = "partial reduce apply total bare model"
pcol(i) = (i == 1 ? 10 : i == 2 ? 11 : i == 3 ? 12 : i == 4 ? 13 : i == 5 ? 16 : 17)
sel(name, col) = (strcol(2) eq name ? column(col) : NaN)
dash(i) = (i >= 5 ? 2 : 1)  # the bare all-reduce and the model dashed

set title "measured (median, slowest rank)"
set xlabel "world size (ranks)"
set ylabel "time per step (us)"
set logscale y
set logscale x 2
set grid
set key outside right top font ",8"
plot for [o = 1:words(ops)] for [i = 1:words(phases)] \
     by_op using 1:(sel(word(ops, o), pcol(i))) \
     title sprintf("%s %s", word(ops, o), word(phases, i)) with linespoints lc (i >= 5 ? i + 2 : i) pt (4 + 2 * o) ps 1.3 dt dash(i)

set title "projected communication time (alpha-beta ring model)"
set xlabel "world size (ranks)"
set logscale x 2
set key outside right top font ",8"
plot for [o = 1:words(ops)] for [m = 1:words(models)] \
     proj using 3:(strcol(1) eq word(ops, o) && strcol(2) eq word(models, m) ? $4 : NaN) \
     title sprintf("%s %s", word(ops, o), word(models, m)) with linespoints lc (m + 5) dt o pt (4 + 2 * o)
unset multiplot
