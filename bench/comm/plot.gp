# plot.gp — the benchmark's chart (gnuplot; run by `./launch/tpnorm bench --plot`).
# Variables from -e: points (measured rows: name|label|world|median_us|min_us), proj (the
# projection CSV: name,topology,algo,world,comm_us), out (the PNG), stat ("median" or "min":
# which of the step's times over the iterations the left panel shows).
# Left: measured time per step against world size, one line per strategy (or op). Right: the
# projected communication time per step on the hierarchical preset (nodes of 8 on NVLink 4,
# NDR InfiniBand between nodes), one line per strategy, same colours; dashed, the first one on
# a flat ring over the network (every rank its own node), the model the old projection used.
set terminal pngcairo size 1500,620 font ",11" noenhanced
set output out
set multiplot layout 1,2 \
    title "tpnorm bench: time per step (forward + backward) of one layer's sharded norm(s)"

# The points sorted by name, then world size, so that each line is drawn without gaps.
sorted = "< sort -t'|' -k1,1 -k3,3n '".points."'"
pmax = system("awk -F'|' '$3 > m {m = $3} END {print m}' '".points."'") + 0
names = system("awk -F'|' '!s[$1]++{printf \"%s \", $1}' '".points."'")
label(n) = system(sprintf("awk -F'|' '$1==\"%s\"{print $2; exit}' '%s'", n, points))
set style line 1 lc rgb "#1b9e77" lw 2.5 pt 7 ps 1.4
set style line 2 lc rgb "#d95f02" lw 2.5 pt 5 ps 1.4
set style line 3 lc rgb "#7570b3" lw 2.5 pt 9 ps 1.6
set style line 4 lc rgb "#e7298a" lw 2.5 pt 11 ps 1.6
set style line 5 lc rgb "#666666" lw 2.5 pt 13 ps 1.4

set datafile separator "|"
scol = (stat eq "min" ? 5 : 4)
set title sprintf("measured on this machine (%s over iterations of the slowest rank's step)", \
                  stat eq "min" ? "fastest" : "median")
set xlabel "world size P (ranks)"
set ylabel "time per step (us)"
set logscale xy
set xtics (1, 2, 4, 8, 16, 32, 64)
set xrange [0.85:pmax * 1.2]
set grid
set key bottom right box opaque font ",10" spacing 1.2
plot for [i = 1:words(names)] sorted using 3:(strcol(1) eq word(names, i) ? column(scol) : NaN) \
     title label(word(names, i)) with linespoints ls i

set datafile separator ","
set title "projected communication, nodes of 8 (NVLink 4 + NDR InfiniBand)"
set ylabel "communication time per step (us)"
set xtics (2, 8, 32, 128, 512, 1024)
set xrange [1.7:1200]
set key top left box opaque font ",10" spacing 1.2
plot for [i = 1:words(names)] proj using 4:(strcol(1) eq word(names, i) && strcol(2) eq "h100x8" \
       && strcol(3) eq "best" ? $5 : NaN) title label(word(names, i)) with linespoints ls i, \
     proj using 4:(strcol(1) eq word(names, 1) && strcol(2) eq "ndr_flat" && strcol(3) eq "ring" \
       ? $5 : NaN) title sprintf("%s, flat ring over NDR (no nodes, no tree)", word(names, 1)) \
       with lines ls 1 dt 2 lw 1.5
unset multiplot
